"""/v1/embeddings through real servers and the `openai` SDK: all-MiniLM-L6-v2 under `--task embed` against
sentence-transformers, and the default decoder's pooled hidden states (`--pooling`) against transformers, also
while a generation streams beside them."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import anthropic
import httpx
import msgpack
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from pagegate.engine.loading.loader import DEFAULT_MODEL
from pagegate.testing.launcher import ServerProcess
from tests.gateway.server_args import server_args

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps the KV cache in fixed-size blocks.",
         "hello", "Ünïcödé, emoji 🎉 and a longer sentence: embeddings batch through the same scheduler " * 3]
COSINE = 1 - 1e-5


@pytest.fixture(scope="module")
def embed_server(minilm_folder: Path):
    process = ServerProcess(["--task", "embed", "--model", str(minilm_folder), "--dtype", "float32", "--device",
                             "cpu", "--disable-uvicorn-access-log", "--grpc-port", "0", "--max-num-batched-tokens", "256"]).start()
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def embed_client(embed_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(minilm_folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder), device="cpu").encode(TEXTS, convert_to_numpy=True)


def assert_same_directions(got: list[list[float]], expected: np.ndarray) -> None:
    ours = torch.tensor(np.array(got, dtype=np.float32))
    cosine = F.cosine_similarity(ours, torch.from_numpy(expected), dim=-1)
    assert (cosine > COSINE).all(), cosine


@pytest.mark.parametrize("encoding_format", ["float", None])  # None: the SDK asks for base64 and decodes it
def test_minilm_equals_sentence_transformers(embed_client: openai.OpenAI, reference: np.ndarray,
                                              encoding_format: str | None):
    extra = {"encoding_format": encoding_format} if encoding_format else {}
    result = embed_client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, **extra)  # type: ignore[arg-type]
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    assert_same_directions([d.embedding for d in result.data], reference)
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS) * 2


def test_one_string_token_ids_and_their_lists(embed_client: openai.OpenAI, embed_server: ServerProcess,
                                              reference: np.ndarray):
    one = embed_client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[1])
    assert_same_directions([one.data[0].embedding], reference[1:2])
    ids = httpx.post(embed_server.base_url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    single = embed_client.embeddings.create(model="all-MiniLM-L6-v2", input=ids)
    assert single.usage.prompt_tokens == len(ids)
    lists = embed_client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids, ids[:3]])
    assert_same_directions([single.data[0].embedding, lists.data[0].embedding], reference[[0, 0]])
    assert len(lists.data) == 2


def test_base64_is_little_endian_float32_and_msgpack_works(embed_server: ServerProcess, reference: np.ndarray):
    url = embed_server.base_url + "/v1/embeddings"
    body = httpx.post(url, json={"input": TEXTS[2], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert_same_directions([vector.tolist()], reference[2:3])
    packed = httpx.post(url, content=msgpack.packb({"input": [TEXTS[2]], "dimensions": 384}),
                        headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    assert packed.headers["content-type"].startswith("application/msgpack")
    assert_same_directions([msgpack.unpackb(packed.content)["data"][0]["embedding"]], reference[2:3])


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, 2, 30522]}, "input"),
    ({"input": ["word"] * 2049}, "input"),
    ({"input": "word " * 300}, "input"),  # past max_seq_length (256)
    ({"input": "hi", "dimensions": 128}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_requests_are_openai_errors(embed_server: ServerProcess, body: dict, param: str):
    response = httpx.post(embed_server.base_url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error"), error


def test_an_embedding_server_refuses_generations(embed_client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        embed_client.completions.create(model="all-MiniLM-L6-v2", prompt="Hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        embed_client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="embedding model"):  # not "no chat template"
        embed_client.responses.create(model="all-MiniLM-L6-v2", input="x")
    claude = anthropic.Anthropic(base_url=str(embed_client.base_url).removesuffix("/v1/"), api_key="unused",
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="embedding model"):
        claude.messages.create(model="all-MiniLM-L6-v2", max_tokens=4, messages=[{"role": "user", "content": "x"}])


# ---- a generative model's pooled hidden states ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pooling_server():
    process = ServerProcess(server_args("--pooling", "mean", "--num-kv-blocks", "256", "--max-num-seqs", "32",
                                        "--max-num-batched-tokens", "64")).start()
    yield process
    assert process.stop() == 0, process.log()[-4000:]


def test_pooled_hidden_states_equal_transformers(pooling_server: ServerProcess):
    transformers = pytest.importorskip("transformers")
    client = openai.OpenAI(base_url=pooling_server.base_url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model="pagegate-default", input=TEXTS)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    tokens = [httpx.post(pooling_server.base_url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    with torch.no_grad():
        expected = np.stack([F.normalize(model.model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0), dim=-1)
                             .numpy() for ids in tokens])
    assert_same_directions([d.embedding for d in result.data], expected)
    assert result.usage.prompt_tokens == sum(map(len, tokens))


def test_embeddings_do_not_stall_or_change_a_streamed_generation(pooling_server: ServerProcess):
    client = openai.OpenAI(base_url=pooling_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def generate() -> str:
        stream = client.completions.create(model="pagegate-default", prompt="Once upon a time", max_tokens=48,
                                           temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    alone = generate()
    stop, answered = threading.Event(), []

    def embed_meanwhile() -> None:
        while not stop.is_set():
            answered.append(len(client.embeddings.create(model="pagegate-default", input=TEXTS).data))

    worker = threading.Thread(target=embed_meanwhile)
    worker.start()
    try:
        beside = generate()
    finally:
        stop.set()
        worker.join(120)
    assert beside == alone and answered and set(answered) == {len(TEXTS)}


# ---- a plain `pagegate serve` (issue 41, items 5 and 10) ------------------------------------------------------


def test_a_plain_server_embeds_from_the_last_tokens_hidden_state(client: openai.OpenAI, server: ServerProcess,
                                                                 model: str):
    """No flag: embeddings.create works, last-token pooling of the final-norm hidden states (as Ollama answers any
    model; the default of --pooling)."""
    transformers = pytest.importorskip("transformers")
    if model != "pagegate-default":
        pytest.skip("$PAGEGATE_TEST_MODEL replaces the embedded model the reference is computed on")
    result = client.embeddings.create(model=model, input=TEXTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    tokens = [httpx.post(server.base_url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    with torch.no_grad():
        expected = np.stack([F.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1).numpy()
                             for ids in tokens])
    assert_same_directions([d.embedding for d in result.data], expected)


def test_one_request_embeds_at_most_300000_tokens(client: openai.OpenAI, model: str):
    """OpenAI's cap (--max-embedding-tokens): 147 inputs of 2,048 tokens are 301,056, refused before any work."""
    inputs = [[(5 * i + p) % 400 + 10 for p in range(2048)] for i in range(147)]
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=model, input=inputs)
    body = error.value.body
    assert body["param"] == "input" and body["code"] == "max_tokens_per_request"
    assert "--max-embedding-tokens" in body["message"] and "300000" in body["message"]
    assert len(client.embeddings.create(model=model, input=inputs[:2]).data) == 2  # within the cap: answered


def test_pooling_none_refuses_with_the_way_to_enable_embeddings():
    process = ServerProcess(server_args("--pooling", "none", "--num-kv-blocks", "128")).start()
    try:
        client = openai.OpenAI(base_url=process.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as error:
            client.embeddings.create(model="pagegate-default", input="hello")
        body = error.value.body
        assert body["code"] == "model_not_supported" and body["type"] == "invalid_request_error"
        assert "--pooling none" in body["message"] and "--task embed" in body["message"]
        assert client.completions.create(model="pagegate-default", prompt="Hi", max_tokens=2).choices  # it generates
    finally:
        assert process.stop() == 0, process.log()[-4000:]
