"""`pagegate serve --enable-lora` through the OpenAI SDK: a request naming an adapter answers as the offline LLM with
that adapter, embeddings too; /v1/models lists adapters with their parent; run-time load and unload
(--allow-runtime-lora); 404 for an unknown adapter, 400 for one that does not fit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pagegate import LLM, SamplingParams
from pagegate.engine.lora import LoRARequest
from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.testing.launcher import ServerProcess
from pagegate.testing.lora import save_random_adapter
from tests.gateway.conftest import SERVER_ARGS

peft = pytest.importorskip("peft")
DEFAULT_MODEL = Path("pagegate/engine/default_model")
PROMPT = "The page pool holds"
MAX_TOKENS = 12


def make_adapter(folder: Path, targets: list[str], rank: int, seed: int) -> Path:
    """A PEFT LoRA over the embedded model with random non-zero A and B (large enough to change its answers)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    save_random_adapter(base, folder, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets), seed,
                        scale=0.2)
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_serve")
    return {"sql": make_adapter(root / "sql", ["q_proj", "v_proj", "down_proj"], 4, 1),
            "poet": make_adapter(root / "poet", ["o_proj", "gate_proj", "up_proj"], 8, 2),
            "wide": make_adapter(root / "wide", ["q_proj"], 32, 3)}  # rank 32: over --max-lora-rank 16


@pytest.fixture(scope="module")
def offline(adapters: dict[str, Path]) -> dict[str | None, str]:
    """Greedy answers of the offline LLM: the base and each adapter that fits."""
    llm = LLM(str(DEFAULT_MODEL), device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=64,
              max_model_len=512, kv_cache_dtype="float32")  # the test servers' pages
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    answers: dict[str | None, str] = {}
    for i, name in enumerate([None, "sql", "poet"]):
        lora = LoRARequest(name, i, str(adapters[name])) if name else None
        answers[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    assert len(set(answers.values())) == 3  # each adapter changes the answer
    return answers


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    args = [*SERVER_ARGS, "--enable-lora", "--max-lora-rank", "16", "--allow-runtime-lora", "--lora-modules",
            f"sql={adapters['sql']}"]
    with ServerProcess(args) as process:
        yield process


def complete(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    return answer.choices[0].text


def test_a_request_naming_an_adapter_answers_as_the_offline_llm(server, adapters, offline) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    base = next(name for name in cards if name != "sql")
    extra = cards["sql"].model_extra or {}
    assert extra["parent"] == base and extra["root"] == str(adapters["sql"])
    assert complete(client, "sql") == offline["sql"]
    assert complete(client, base) == offline[None]
    with pytest.raises(openai.NotFoundError) as unknown:
        complete(client, "nobody")
    assert unknown.value.code == "model_not_found"


def offline_embeddings(adapters: dict[str, Path]) -> dict[str | None, np.ndarray]:
    """The prompt's embedding (the last token's hidden state, as the server pools) offline: the base and "sql"."""
    llm = LLM(str(DEFAULT_MODEL), device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=64,
              max_model_len=512, pooling="last", kv_cache_dtype="float32")  # the test servers' pages
    sql = LoRARequest("sql", 1, str(adapters["sql"]))
    base, adapted = llm.embed([PROMPT, PROMPT], use_tqdm=False, lora_request=[None, sql])
    return {None: np.array(base.outputs.embedding), "sql": np.array(adapted.outputs.embedding)}


def test_embeddings_naming_an_adapter_run_with_it(server, adapters) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    base = (next(card for card in client.models.list().data if card.id == "sql").model_extra or {})["parent"]
    served = {name: np.array(client.embeddings.create(model=model, input=PROMPT).data[0].embedding)
              for name, model in ((None, base), ("sql", "sql"))}
    expected = offline_embeddings(adapters)
    for name, vector in served.items():
        np.testing.assert_allclose(vector, expected[name], atol=1e-5, err_msg=str(name))
    assert np.abs(served["sql"] - served[None]).max() > 1e-2  # the adapter changes the embedding


def test_adapters_load_and_unload_at_run_time(server, adapters, offline) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    http = httpx.Client(base_url=server.base_url, timeout=60)
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["poet"])})
    assert loaded.status_code == 200, loaded.text
    assert complete(client, "poet") == offline["poet"]
    assert "poet" in {card.id for card in client.models.list().data}
    too_big = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(adapters["wide"])})
    assert too_big.status_code == 400 and "rank 32" in too_big.json()["error"]["message"]
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/no/such/folder"})
    assert missing.status_code == 400
    stream = client.completions.create(model="poet", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # it runs with the adapter: unloading is refused, the request goes on
    busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_busy"
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) > 0
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "poet")
    unknown = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_the_flags_make_the_engine_config(adapters) -> None:
    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "2", "--lora-modules",
                                      f"a={adapters['sql']}", f'{{"name": "b", "path": "{adapters["poet"]}"}}'])
    engine, gateway = configs_from_args(args)
    assert engine.lora is not None and engine.lora.max_loras == 2
    assert engine.lora.modules == (("a", str(adapters["sql"])), ("b", str(adapters["poet"])))
    assert not gateway.allow_runtime_lora
    with pytest.raises(SystemExit):
        configs_from_args(build_parser().parse_args(["serve", "--lora-modules", "a=/x"]))
