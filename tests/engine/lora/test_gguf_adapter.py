"""GGUF LoRA adapters, written by llama.cpp's own converter (convert_lora_to_gguf.py) from a PEFT folder: the same
greedy answers as that folder, over a HF base and a GGUF base; files that are not LoRA adapters refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import llamacpp
from pagegate import LLM
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.lora import LoRARequest

from ..conftest import SavedModel
from ..loading.gguf_files import write_gguf
from .test_lora import ALL, PATHS, PROMPTS, hf_greedy, lora_llm, make_adapter, tokens

pytest.importorskip("peft")


def convert(adapter: Path, base: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter run as llama.cpp's users run it: the PEFT folder and the base's HF folder (the vendored
    tree is unpacked on first use, as the family tests' model converter is)."""
    converter = llamacpp.source_dir() / "convert_lora_to_gguf.py"
    subprocess.run([sys.executable, str(converter), "--base", str(base), "--outfile", str(out), "--outtype",
                    outtype, str(adapter)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def peft_and_gguf(llama_model: SavedModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    """A rank-4 adapter on every projection (Q and K rows are permuted in the GGUF form), as a PEFT folder and as
    llama.cpp's GGUF, with transformers + peft's greedy answers."""
    folder = tmp_path_factory.mktemp("lora_peft")
    model = make_adapter(llama_model.hf_model, folder, ALL, 4, 8, False, seed=7)
    gguf_file = convert(folder, llama_model.path, folder.parent / "lora.gguf")
    return folder, gguf_file, [hf_greedy(model, p) for p in PROMPTS]


@pytest.mark.parametrize("path", PATHS)
def test_a_gguf_adapter_answers_as_its_peft_folder(llama_model, peft_and_gguf, tmp_path, path):
    folder, gguf_file, reference = peft_and_gguf
    llm = lora_llm(llama_model.path, path)
    from_peft = tokens(llm, PROMPTS, [LoRARequest("peft", 1, str(folder))] * len(PROMPTS))
    from_gguf = tokens(llm, PROMPTS, [LoRARequest("gguf", 2, str(gguf_file))] * len(PROMPTS))
    assert from_gguf == from_peft == reference
    assert tokens(llm, PROMPTS, [None] * len(PROMPTS)) != reference  # the adapter changes the answers
    gguf_base = lora_llm(write_gguf(tmp_path / "model.gguf", llama_model.hf_model, "llama"), path)
    assert tokens(gguf_base, PROMPTS, [LoRARequest("gguf", 1, str(gguf_file))] * len(PROMPTS)) == reference


def test_gguf_files_that_are_not_fitting_lora_adapters_are_refused_by_name(llama_model, peft_and_gguf, tmp_path):
    folder, _, _ = peft_and_gguf
    llm = LLM(str(llama_model.path), device="cpu", enable_lora=True, max_lora_rank=2, num_kv_blocks=64)
    model_file = write_gguf(tmp_path / "model.gguf", llama_model.hf_model, "llama")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(model_file.read_bytes()[:100])
    cases = {model_file: "not a LoRA adapter", truncated: "cannot read", folder.parent / "lora.gguf": "rank 4"}
    for i, (file, reason) in enumerate(cases.items()):
        with pytest.raises(InvalidParamError, match=reason):
            llm.generate(PROMPTS[0], use_tqdm=False, lora_request=LoRARequest(f"bad{i}", i + 1, str(file)))
    assert not llm.engine.runner.lora.registered
