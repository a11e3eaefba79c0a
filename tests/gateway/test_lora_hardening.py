"""Run-time LoRA adapters hardened (issue 64), through a real server: an adapter's folder removed or rewritten after
its load changes nothing served (its checked weights stay in host memory); configs, weights and paths that cannot
serve are a 400 naming lora_path; a file that is not an adapter is refused before it is read; --lora-dir."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pagegate.gateway.cli import build_parser, configs_from_args
from pagegate.testing.launcher import ServerProcess
from pagegate.testing.lora import lora_tensors, write_adapter
from tests.gateway.server_args import server_args

# the adapters written here are shaped for the embedded model, so its servers serve it whatever $PAGEGATE_TEST_MODEL says
SERVER_ARGS = server_args(embedded=True)
_CONFIG = json.loads(Path("pagegate/engine/default_model/config.json").read_text())
_HIDDEN, _HEAD_DIM = _CONFIG["hidden_size"], _CONFIG["head_dim"]
SHAPES = {"q_proj": (_HIDDEN, _CONFIG["num_attention_heads"] * _HEAD_DIM),
          "v_proj": (_HIDDEN, _CONFIG["num_key_value_heads"] * _HEAD_DIM)}
LAYERS = _CONFIG["num_hidden_layers"]
PEFT_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
PROMPT = "The page pool holds"
MAX_TOKENS = 8
LORA_ARGS = ["--enable-lora", "--allow-runtime-lora", "--max-loras", "1", "--max-lora-rank", "16"]


def adapter(folder: Path, seed: int, config: Any = PEFT_CONFIG, config_text: str | None = None,
            tensors: dict[str, np.ndarray] | None = None) -> Path:
    return write_adapter(folder, tensors if tensors is not None else lora_tensors(SHAPES, LAYERS, 4, seed, 0.3),
                         config, config_text)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess([*SERVER_ARGS, *LORA_ARGS]) as process:
        yield process


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def load(http: httpx.Client, name: str, path: str | Path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def complete(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    return answer.choices[0].text


def base_model(client: openai.OpenAI) -> str:
    return next(card.id for card in client.models.list().data if (card.model_extra or {}).get("parent") is None)


def refused(response: httpx.Response, fragment: str) -> None:
    """A 400 in OpenAI's error shape that names lora_path and says `fragment`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == "lora_path" and fragment in error["message"], error


def test_adapter_folders_removed_or_rewritten_after_their_load_change_nothing_served(server, http, client,
                                                                                     tmp_path) -> None:
    folders = {name: adapter(tmp_path / name, seed) for seed, name in enumerate("abcd", start=1)}
    for name, folder in folders.items():
        assert load(http, name, folder).status_code == 200
    stream = client.completions.create(model=base_model(client), prompt=PROMPT, max_tokens=120, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # a base stream in flight through all of it
    answers = {name: complete(client, name) for name in "abd"}  # --max-loras 1: each evicts the one before
    assert len(set(answers.values())) == 3
    shutil.rmtree(folders["a"])
    shutil.rmtree(folders["c"])  # gone before its first use
    adapter(folders["d"], seed=99)  # rewritten in place with other weights
    assert complete(client, "a") == answers["a"]  # paged in again from the host copy, not the folder
    assert complete(client, "c")
    assert complete(client, "d") == answers["d"]  # the weights checked at load, under the identity they had
    assert load(http, "d2", folders["d"]).status_code == 200
    assert complete(client, "d2") != answers["d"]  # the rewrite did change the weights
    finished = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert [chunk.choices[0].finish_reason for chunk in finished] == ["length"]
    assert server.process.poll() is None and http.get("/health").status_code == 200


CONFIG_TEXT = json.dumps(PEFT_CONFIG)
_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _weights(change: Any) -> dict[str, np.ndarray]:
    tensors = lora_tensors(SHAPES, LAYERS, 4, 5, 0.3)
    return {**tensors, _KEY: change(tensors[_KEY])}


# case: (adapter_config.json's text or a config, the weights (None: sane ones), what the 400 says)
BAD_ADAPTERS: dict[str, tuple[Any, dict[str, np.ndarray] | None, str]] = {
    "r 0": ({**PEFT_CONFIG, "r": 0}, None, "r (the LoRA rank) must be a positive integer, got 0"),
    "r null": ({**PEFT_CONFIG, "r": None}, None, "got None"),
    "r 1e999": (CONFIG_TEXT.replace('"r": 4', '"r": 1e999'), None, "got inf"),
    "r -1": ({**PEFT_CONFIG, "r": -1}, None, "got -1"),
    "config a list": ("[4, 8]", None, "is not a JSON object"),
    "config a string": ('"lora"', None, "is not a JSON object"),
    "lora_alpha NaN": (CONFIG_TEXT.replace('"lora_alpha": 8', '"lora_alpha": NaN'), None,
                       "lora_alpha must be a finite number"),
    "lora_alpha 1e38": ({**PEFT_CONFIG, "lora_alpha": 1e38}, None, "lora_alpha 1e+38 over r 4"),
    "NaN weights": (PEFT_CONFIG, _weights(lambda t: np.where(t > 0, np.nan, t)), f"tensor {_KEY} holds NaN"),
    "Inf weights": (PEFT_CONFIG, _weights(lambda t: np.where(t > 0, np.inf, t)), f"tensor {_KEY} holds NaN or Inf"),
    "int64 weights": (PEFT_CONFIG, _weights(lambda t: (t * 10).astype(np.int64)), f"tensor {_KEY} is int64"),
    "bool weights": (PEFT_CONFIG, _weights(lambda t: t > 0), f"tensor {_KEY} is bool"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_adapters_that_cannot_serve_are_a_400_naming_lora_path(http, client, tmp_path, case) -> None:
    config, tensors, says = BAD_ADAPTERS[case]
    text = config if isinstance(config, str) else None
    name = "bad-" + case.replace(" ", "-")  # one name a case: an adapter wrongly accepted takes only its own
    folder = adapter(tmp_path / "bad", 5, config if text is None else None, text, tensors)
    refused(load(http, name, folder), says)
    assert name not in {card.id for card in client.models.list().data}


@pytest.mark.parametrize("path", ["/proc/self/mem", "/tmp/" + "x" * 300 + "/adapter"])
def test_paths_that_cannot_be_read_are_a_400_naming_lora_path(http, client, path) -> None:
    refused(load(http, "bad", path), "cannot read")
    assert complete(client, base_model(client))  # the engine serves on


def model_gguf(path: Path, size: int, keys: int = 0, kind: str = "model") -> Path:
    """A GGUF file of `size` bytes (sparse) whose header says general.type `kind` and holds `keys` more keys."""
    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value)) + value.encode()

    entries = [text("general.type") + struct.pack("<I", 8) + text(kind)]
    entries += [text(f"filler.{i}") + struct.pack("<IB", 0, 1) for i in range(keys)]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries))
    os.truncate(path, size)
    return path


def test_files_that_are_not_adapters_are_refused_before_they_are_read(http, client, tmp_path) -> None:
    stream = client.completions.create(model=base_model(client), prompt=PROMPT, max_tokens=60, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    refused(load(http, "model", model_gguf(tmp_path / "model.gguf", 300 << 20)),
            "not a LoRA adapter (general.type 'model'); it is not read")
    refused(load(http, "keys", model_gguf(tmp_path / "keys.gguf", 1 << 20, keys=5000, kind="adapter")),
            "5001 header keys")
    big = adapter(tmp_path / "big", 1)
    os.truncate(big / "adapter_model.safetensors", 100 << 20)  # more than rank 16 over every module can take
    refused(load(http, "big", big), "more than an adapter of rank --max-lora-rank 16 over this model can take")
    finished = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert [chunk.choices[0].finish_reason for chunk in finished] == ["length"]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_dir")
    adapter(root / "allowed" / "inside", 1)
    adapter(root / "outside", 2)
    (root / "allowed" / "link").symlink_to(root / "outside")
    return root


@pytest.fixture(scope="module")
def dir_server(lora_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess([*SERVER_ARGS, *LORA_ARGS, "--lora-dir", str(lora_dir / "allowed")]) as process:
        yield process


def test_lora_dir_takes_adapters_from_inside_it_only(dir_server, lora_dir) -> None:
    with httpx.Client(base_url=dir_server.base_url, timeout=120) as http:
        assert load(http, "inside", lora_dir / "allowed" / "inside").status_code == 200
        for name, path in {"outside": lora_dir / "outside", "link": lora_dir / "allowed" / "link",
                           "dotdot": f"{lora_dir / 'allowed'}/../outside"}.items():
            refused(load(http, name, path), "is not inside --lora-dir")
    client = openai.OpenAI(base_url=dir_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert complete(client, "inside")


def test_the_lora_dir_flag_makes_the_engine_config(tmp_path) -> None:
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-dir", str(tmp_path)])
    engine, _ = configs_from_args(args)
    assert engine.lora is not None and engine.lora.lora_dir == str(tmp_path)
    assert configs_from_args(build_parser().parse_args(["serve", "--enable-lora"]))[0].lora.lora_dir is None
    with pytest.raises(SystemExit):
        configs_from_args(build_parser().parse_args(["serve", "--lora-dir", str(tmp_path)]))
