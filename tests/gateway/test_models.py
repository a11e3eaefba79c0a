"""Several models behind one server (--model repeated, --models-dir): the embedded model, a tiny GGUF and a tiny
Hugging Face folder, driven through the OpenAI SDK: routing by `model`, the 404 for an unknown one, load on demand,
--models-max eviction of the least recently used idle model (never one serving), sleep and wake with greedy outputs
unchanged, the page budget moving between models, a killed core isolated (and loaded again on its next request);
then --models-dir with SmolLM2's GGUF, and --sleep-idle-seconds."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

import pagegate
from pagegate.clients.grpc_client import GrpcClient
from pagegate.clients.msgpack_client import MsgpackClient
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.gateway.settings import ServedModel
from pagegate.testing.launcher import ServerProcess, core_pids, free_port, wait_for

from ..engine.conftest import TINY, hf, save_hf_model
from ..engine.loading.gguf_files import write_gguf

# float32 pages by name: the page sizes and budgets below are float32's (the CPU's default is int8)
BASE_ARGS = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--device", "cpu", "--disable-uvicorn-access-log",
             "--grpc-port", "0")
DEFAULT_MODEL = str(Path(pagegate.__file__).parent / "engine" / "default_model")
PROMPT_IDS = [5, 17, 42, 9, 33, 71]  # the folder model has no tokenizer: token ids work for all three


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> path: the embedded model's folder, a tiny GGUF (with a byte tokenizer), a tiny HF folder."""
    folder = save_hf_model(tmp_path_factory.mktemp("tinyhf"), hf().LlamaConfig(**TINY, bos_token_id=1,
                                                                                eos_token_id=2), seed=11)
    gguf_model = save_hf_model(tmp_path_factory.mktemp("tinygguf-src"),
                               hf().LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2), seed=12)
    gguf = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gguf_model.hf_model)
    return {"default_model": DEFAULT_MODEL, "tiny": str(gguf), "tinyhf": str(folder.path)}


GRPC_PORT = free_port()


@pytest.fixture(scope="module")
def server(model_files: dict[str, str]) -> Iterator[ServerProcess]:
    args = [arg for path in model_files.values() for arg in ("--model", path)]
    args += ["--served-model-name", *model_files, "--models-max", "2", "--max-model-len", "128", "--kv-cache-memory",
             "64MiB", "--max-num-seqs", "8"]
    process = ServerProcess([*BASE_ARGS, *args, "--grpc-port", str(GRPC_PORT)]).start()  # last: wins over 0
    yield process
    code = process.stop()
    assert code == 0, f"the server did not stop cleanly ({code}):\n{process.log()[-4000:]}"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as session:
        yield session


def states(http: httpx.Client) -> dict[str, str]:
    return {card["id"]: card["state"] for card in http.get("/v1/models").json()["data"]}


def greedy(client: openai.OpenAI, model: str) -> list[str]:
    """The greedy answer's tokens (as logprobs name them: the folder model has no tokenizer)."""
    reply = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    assert reply.model == model
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.tokens is not None
    return list(reply.choices[0].logprobs.tokens)


def test_flags_make_one_entry_per_model(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    args = build_parser().parse_args(["--model", "/m/a.gguf", "--models-dir", str(tmp_path),
                                      "--served-model-name", "first", "--models-max", "2"])
    engine, gateway = configs_from_args(args)
    assert gateway.models == [ServedModel("first", "/m/a.gguf"), ServedModel("b", str(tmp_path / "b.gguf")),
                              ServedModel("c", str(tmp_path / "c"))]
    assert engine.model == "/m/a.gguf" and gateway.models_max == 2 and gateway.served_model_names == []
    one = configs_from_args(build_parser().parse_args(["--model", "/m", "--served-model-name", "a", "b"]))[1]
    assert one.models == [] and one.served_model_names == ["a", "b"]  # one model: the names are aliases
    for wrong, message in ((["--model", "/a/x.gguf", "--model", "/b/x.gguf"], "same name"),
                           (["--model", "/a", "--model", "/b", "--served-model-name", "1", "2", "3"], "3 names"),
                           (["--models-dir", str(tmp_path / "notes.txt")], "not a folder")):
        with pytest.raises(SystemExit, match=message):
            configs_from_args(build_parser().parse_args(wrong))


def test_models_lists_every_model_with_its_state(http: httpx.Client) -> None:
    listed = states(http)
    assert set(listed) == {"default_model", "tiny", "tinyhf"}
    assert listed["default_model"] in ("loaded", "sleeping")  # the default loads at start; the others on demand


def test_the_dashboard_shows_each_models_state_and_share(http: httpx.Client) -> None:
    assert http.post("/models/load", json={"model": "default_model"}).status_code == 200  # the pool it shows
    with http.stream("GET", "/dashboard/api/feed") as response:
        frame = next(json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: "))
    assert frame["models"].startswith("default_model loaded ") and "MiB" in frame["models"]
    assert "tinyhf" in frame["models"]


def test_unknown_model_is_a_404_naming_the_models(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "default_model" in error["message"] and "tinyhf" in error["message"]


def test_requests_route_by_model_and_load_on_demand(client: openai.OpenAI, http: httpx.Client) -> None:
    text = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert text.model == "tiny" and text.usage.completion_tokens >= 1
    assert states(http)["tiny"] == "loaded"
    tokens = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()["tokens"]
    assert tokens == http.post("/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()["tokens"]
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert greedy(client, "default_model") == greedy(client, "default_model")


def test_embeddings_and_chat_route_by_model(client: openai.OpenAI, http: httpx.Client) -> None:
    """Each model embeds with its own hidden size; chat goes to the model named (the embedded one has a template)."""
    sizes = {name: len(client.embeddings.create(model=name, input=[PROMPT_IDS]).data[0].embedding)
             for name in ("default_model", "tiny")}
    assert sizes["tiny"] == TINY["hidden_size"] and sizes["default_model"] != sizes["tiny"]
    chat = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "default_model" and chat.usage.completion_tokens >= 1
    info = http.get("/tokenizer_info", params={"model": "tiny"}).json()
    assert info["vocab_size"] == TINY["vocab_size"]


def test_grpc_and_msgpack_route_by_model(server: ServerProcess) -> None:
    grpc_client = GrpcClient(f"127.0.0.1:{GRPC_PORT}", timeout=120)
    try:
        assert {card["id"]: card["state"] for card in grpc_client.models()}.keys() == {"default_model", "tiny",
                                                                                      "tinyhf"}
        assert grpc_client.completions(PROMPT_IDS, model="tiny", max_tokens=2)["model"] == "tiny"
    finally:
        grpc_client.close()
    with MsgpackClient(server.base_url, timeout=120) as msgpack_client:
        assert msgpack_client.completions(PROMPT_IDS, model="default_model", max_tokens=2)["model"] == "default_model"


def test_models_max_unloads_the_least_recently_used_idle_model(client: openai.OpenAI, http: httpx.Client) -> None:
    greedy(client, "default_model")
    greedy(client, "tiny")  # the two loaded now, tiny the most recently used
    greedy(client, "tinyhf")  # a third: default_model goes
    listed = states(http)
    assert listed["tinyhf"] == "loaded" and listed["tiny"] == "loaded" and listed["default_model"] == "unloaded"
    assert sum(state == "loaded" for state in listed.values()) == 2
    greedy(client, "default_model")  # back on its next request, tiny (now least recently used) going
    assert states(http)["tiny"] == "unloaded"


def test_sleep_and_wake_keep_greedy_outputs(client: openai.OpenAI, http: httpx.Client) -> None:
    before = greedy(client, "tinyhf")
    slept = http.post("/sleep", params={"model": "tinyhf"})
    assert slept.status_code == 200, slept.text
    assert http.get("/is_sleeping", params={"model": "tinyhf"}).json()["is_sleeping"] is True
    assert states(http)["tinyhf"] == "sleeping"
    metrics = http.get("/metrics").text
    assert 'pagegate:model_kv_blocks_total{model_name="tinyhf"} 0.0' in metrics
    assert greedy(client, "tinyhf") == before  # woken by the request, fresh pages, same answer
    assert http.get("/is_sleeping", params={"model": "tinyhf"}).json()["is_sleeping"] is False


def budgets(http: httpx.Client) -> dict[str, float]:
    """Each model's share of the page budget, from /metrics."""
    prefix = 'pagegate:model_kv_budget_bytes{model_name="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)}


def test_loaded_models_start_at_their_floor_within_the_budget(client: openai.OpenAI, http: httpx.Client) -> None:
    """64 MiB for the server, --models-max 2: a floor of 8 MiB each; short requests never need more, and an
    idle model's pool is back at its floor (its answers unchanged)."""
    mib = 2**20
    for name in ("default_model", "tiny"):
        assert http.post("/models/load", json={"model": name}).status_code == 200
    before = greedy(client, "default_model")
    greedy(client, "tiny")
    wait_for(lambda: budgets(http).get("default_model") == 8 * mib and budgets(http).get("tiny") == 8 * mib,
             "both models at their floors")
    assert sum(budgets(http).values()) <= 64 * mib
    assert greedy(client, "default_model") == before


def burst(client: openai.OpenAI, model: str, requests: int = 8) -> None:
    """`requests` completions at once, 100 prompt tokens and 24 output tokens each (8 pages of 16 tokens)."""
    def one(index: int) -> None:
        prompt = [(index * 7 + i * 13) % 240 + 3 for i in range(100)]
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.completion_tokens == 24

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))


def pool_pages(http: httpx.Client, model: str) -> float:
    prefix = f'pagegate:model_kv_blocks_total{{model_name="{model}"}} '
    return next(float(line[len(prefix):]) for line in http.get("/metrics").text.splitlines()
                if line.startswith(prefix))


def test_a_busy_models_pool_grows_while_the_other_idles(model_files: dict[str, str]) -> None:
    """1 MiB of 8 KiB pages (128) for two tiny models, a floor of 16 pages each: a burst of 8 requests needing 64
    pages grows the busy model's pool from the shared budget while the idle one keeps its floor; idle again, it
    gives them back, and the other model's burst takes them. Greedy answers are unchanged by the moves."""
    kib, floor = 1024, 128 * 1024
    args = ["--model", model_files["tiny"], "--model", model_files["tinyhf"], "--served-model-name", "tiny", "tinyhf",
            "--models-max", "2", "--max-model-len", "128", "--kv-cache-memory", f"{1024 * kib}"]
    with ServerProcess([*BASE_ARGS, *args]) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert http.post("/models/load", json={"model": "tinyhf"}).status_code == 200
        before = greedy(client, "tiny")
        for busy, idle in (("tiny", "tinyhf"), ("tinyhf", "tiny")):
            wait_for(lambda: budgets(http) == {"tiny": floor, "tinyhf": floor}, "both pools at their floors")
            burst(client, busy)
            shares = budgets(http)  # read at once: a pool shrinks only after REBALANCE_IDLE_S idle
            assert shares[busy] > floor and shares[idle] == floor, shares
            assert sum(shares.values()) <= 1024 * kib
            assert pool_pages(http, busy) * 8 * kib == shares[busy]  # the live limit, as the share says
        assert greedy(client, "tiny") == before
        wait_for(lambda: budgets(http) == {"tiny": floor, "tinyhf": floor}, "both pools back at their floors")


def test_load_and_unload_by_hand(http: httpx.Client) -> None:
    assert http.post("/models/unload", json={"model": "tinyhf"}).json()["state"] == "unloaded"
    assert states(http)["tinyhf"] == "unloaded"
    assert http.post("/models/load", json={"model": "tinyhf"}).json()["state"] == "loaded"
    assert http.post("/models/load", json={"model": "nope"}).status_code == 404


def core_of(http: httpx.Client, server: ServerProcess, model: str) -> int:
    """The pid of `model`'s engine core: the one that appears when it is loaded afresh."""
    assert server.process is not None
    http.post("/models/unload", json={"model": model})
    before = set(core_pids(server.process.pid))
    assert http.post("/models/load", json={"model": model}).status_code == 200
    (core,) = set(core_pids(server.process.pid)) - before
    return core


def test_a_model_serving_a_request_is_never_unloaded(client: openai.OpenAI, http: httpx.Client,
                                                     server: ServerProcess) -> None:
    """--models-max 2: tiny is the least recently used but serves a request (its core stopped mid-way), so loading
    a third model unloads the other one; unloading tiny by hand is a 409 until its request is done."""
    http.post("/models/unload", json={"model": "tinyhf"})
    tiny_core = core_of(http, server, "tiny")
    greedy(client, "default_model")  # tiny is now the least recently used
    os.kill(tiny_core, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(greedy, client, "tiny")
            wait_for(lambda: http.get("/health").json()["models"]["tiny"]["in_flight"] == 1, "tiny's request")
            greedy(client, "tinyhf")
            listed = states(http)
            assert listed["tiny"] == "loaded" and listed["tinyhf"] == "loaded"
            assert listed["default_model"] == "unloaded"
            busy = http.post("/models/unload", json={"model": "tiny"})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
            os.kill(tiny_core, signal.SIGCONT)
            assert len(waiting.result(timeout=60)) == 8
    finally:
        os.kill(tiny_core, signal.SIGCONT)


def test_a_killed_core_fails_its_model_alone(client: openai.OpenAI, http: httpx.Client,
                                             server: ServerProcess) -> None:
    tiny_core = core_of(http, server, "tiny")
    other = next(name for name, state in states(http).items() if state == "loaded" and name != "tiny")
    expected = greedy(client, "tiny")
    os.kill(tiny_core, signal.SIGKILL)
    wait_for(lambda: http.get("/health").json()["models"]["tiny"]["state"] in ("failed", "unloaded"),
             "the killed model to be marked failed")
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] in ("degraded", "ok")
    greedy(client, other)  # the other model serves on
    assert greedy(client, "tiny") == expected  # loaded again on its next request
    assert http.get("/health").json()["status"] == "ok"


def test_an_idle_model_falls_asleep_and_wakes_on_its_next_request(model_files: dict[str, str]) -> None:
    args = ["--model", model_files["default_model"], "--model", model_files["tiny"], "--sleep-idle-seconds", "1",
            "--served-model-name", "default_model", "tiny",
            "--max-model-len", "128", "--kv-cache-memory", "32MiB"]
    with ServerProcess([*BASE_ARGS, *args]) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        before = greedy(client, "tiny")
        wait_for(lambda: http.get("/is_sleeping", params={"model": "tiny"}).json()["is_sleeping"],
                 "tiny to fall asleep", timeout_s=30)
        assert greedy(client, "tiny") == before


def test_models_dir_serves_each_file_and_folder(smollm2_gguf: Path, tmp_path: Path) -> None:
    """--models-dir with SmolLM2's GGUF and the embedded model's folder: both listed by file or folder name, the
    first in name order loaded at start, the other on its first request; a chat to each."""
    (tmp_path / smollm2_gguf.name).symlink_to(smollm2_gguf)
    (tmp_path / "default_model").symlink_to(DEFAULT_MODEL, target_is_directory=True)
    smollm2 = smollm2_gguf.stem
    args = ["--models-dir", str(tmp_path), "--max-model-len", "256", "--kv-cache-memory", "64MiB"]
    with ServerProcess([*BASE_ARGS, *args]) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert states(http) == {smollm2: "loaded", "default_model": "unloaded"}
        for name in (smollm2, "default_model"):
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0)
            assert reply.model == name and reply.usage.completion_tokens >= 1
        assert states(http) == {smollm2: "loaded", "default_model": "loaded"}
