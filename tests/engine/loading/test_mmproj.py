"""SmolVLM's and Gemma 3's vision side from the mmproj GGUF llama.cpp's own converter writes (`convert_hf_to_gguf.py
--mmproj`): the same image-token rows as the Hugging Face folder (F32 exactly, F16 within its rounding), the same
preprocessing, the same answers, and files that are no projector read here refused by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from bench.peers import llamacpp
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_reader import GGUFContents
from pagegate.engine.loading.mmproj import is_mmproj, load_mmproj
from pagegate.engine.media.gemma3 import Gemma3Processing
from pagegate.engine.media.idefics3 import Idefics3Processing
from pagegate.engine.models.gemma3_vision import Gemma3Vision, load_gemma3_vision
from pagegate.engine.models.idefics3_vision import load_idefics3_vision
from tests.engine.vision_models import save_gemma3_vision, save_smolvlm

OUTTYPES = ("f32", "f16")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_smolvlm(tmp_path_factory.mktemp("smolvlm"), seed=5).path


@pytest.fixture(scope="module")
def converted(folder: Path) -> dict[str, Path]:
    """The folder as llama.cpp converts it: its vision side F32 and F16 (`--mmproj`), its text model F32."""
    def convert(kind: str) -> Path:
        if kind == "text":
            return llamacpp.convert(folder, folder.parent / "smolvlm-f32.gguf", "f32")
        return llamacpp.convert(folder, folder.parent / f"mmproj-{kind}.gguf", kind, extra_args=("--mmproj",))

    kinds = (*OUTTYPES, "text")
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(kinds, pool.map(convert, kinds), strict=True))


@pytest.fixture(scope="module")
def mmproj(converted: dict[str, Path]) -> dict[str, Path]:
    return {kind: converted[kind] for kind in OUTTYPES}


def test_a_gguf_model_with_its_mmproj_answers_as_the_folder_does(folder: Path, converted: dict[str, Path]) -> None:
    """`--mmproj`: the GGUF text model reads images through the mmproj file, token for token as the folder."""
    from PIL import Image

    from pagegate.engine.llm import LLM
    from pagegate.engine.sampling.params import SamplingParams

    image = Image.fromarray(np.random.default_rng(6).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    prompt = {"prompt": "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:",
              "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    answers = []
    for model, mmproj in ((str(folder), None), (str(converted["text"]), str(converted["f32"]))):
        llm = LLM(model, mmproj=mmproj, device="cpu", num_kv_blocks=32, max_model_len=512,
                  kv_cache_dtype="float32")
        answers.append(llm.generate(prompt, params, use_tqdm=False)[0])
    folder_answer, gguf_answer = answers
    assert gguf_answer.prompt_token_ids == folder_answer.prompt_token_ids
    assert gguf_answer.outputs[0].token_ids == folder_answer.outputs[0].token_ids


def test_an_mmproj_needs_a_gguf_model(folder: Path, converted: dict[str, Path]) -> None:
    from pagegate.engine.llm import LLM

    with pytest.raises(ModelLoadError, match="--mmproj goes with a GGUF model"):
        LLM(str(folder), mmproj=str(converted["f32"]), device="cpu", num_kv_blocks=32, max_model_len=512)


@pytest.fixture(scope="module")
def tiles(folder: Path) -> torch.Tensor:
    pixels = np.random.default_rng(3).integers(0, 256, (230, 310, 3), dtype=np.uint8)
    processing = Idefics3Processing.from_folder(folder)
    return torch.from_numpy(processing.normalize(processing.prepare(pixels).tiles))


@pytest.mark.parametrize(("outtype", "tolerance"), [("f32", 1e-4), ("f16", 1e-2)])
def test_an_mmproj_encodes_tiles_as_the_folder_does(folder: Path, mmproj: dict[str, Path], tiles: torch.Tensor,
                                                    outtype: str, tolerance: float) -> None:
    vision, _ = load_mmproj(mmproj[outtype])
    expected = load_idefics3_vision(folder).encode(tiles)
    got = vision.encode(tiles)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (tiles.shape[0] * 16, 64)
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    types = {t.name: t.tensor_type for t in GGUFContents(mmproj[outtype]).tensors}
    assert types["v.blk.0.attn_q.weight"] == GGMLQuantizationType[outtype.upper()]  # F16 really was read as F16


def test_an_mmproj_preprocesses_as_the_folder_does(folder: Path, mmproj: dict[str, Path]) -> None:
    """The clip.* metadata carry the tile size, the longest edge, mean and std, and (with the patch size and scale
    factor) the image tokens per tile; llama.cpp always resizes with LANCZOS and splits, as this folder does."""
    _, processing = load_mmproj(mmproj["f32"])
    assert processing == Idefics3Processing.from_folder(folder)
    pixels = np.random.default_rng(4).integers(0, 256, (90, 400, 3), dtype=np.uint8)
    ours, theirs = processing.prepare(pixels), Idefics3Processing.from_folder(folder).prepare(pixels)
    assert ours.text == theirs.text and np.array_equal(ours.tiles, theirs.tiles)


def test_is_mmproj_tells_projectors_from_other_files(folder: Path, mmproj: dict[str, Path], tmp_path: Path) -> None:
    assert is_mmproj(mmproj["f32"]) and is_mmproj(mmproj["f16"])
    text = _rewrite(mmproj["f32"], tmp_path / "text.gguf", arch="llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mmproj["f32"].read_bytes()[:200])
    for path in (text, cut, folder / "config.json", tmp_path / "absent.gguf"):
        assert not is_mmproj(path)


@pytest.mark.parametrize(("change", "message"), [
    ({"arch": "llama"}, "not a multimodal projector"),
    ({"values": {"clip.projector_type": "qwen2.5vl_merger"}}, "projector type 'qwen2.5vl_merger' is not supported"),
    ({"drop": ("v.blk.1.attn_v.weight",)}, "missing tensor(s): v.blk.1.attn_v.weight"),
    ({"drop": ("clip.vision.patch_size",)}, "lacks the metadata key clip.vision.patch_size"),
    ({"extra": "v.blk.0.attn_qkv.weight"}, "unexpected tensor v.blk.0.attn_qkv.weight"),
])
def test_files_that_are_not_idefics3_projectors_are_refused_by_name(mmproj: dict[str, Path], tmp_path: Path,
                                                                    change: dict[str, Any], message: str) -> None:
    path = _rewrite(mmproj["f32"], tmp_path / "changed.gguf", **change)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_mmproj(path)


def test_a_truncated_or_absent_file_is_refused(mmproj: dict[str, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mmproj["f32"].read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_mmproj(cut)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_mmproj(tmp_path / "absent.gguf")


def _rewrite(source: Path, out: Path, arch: str = "clip", values: dict[str, Any] | None = None,
             drop: tuple[str, ...] = (), extra: str | None = None) -> Path:
    """`source` written again with its architecture, some values changed, keys or tensors dropped, a tensor added."""
    reader = GGUFReader(source)
    writer = GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", *drop):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, (values or {}).get(name, field.contents()), field.types[0], sub_type)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    if extra:
        writer.add_tensor(extra, np.zeros((96, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Gemma 3 folder and llama.cpp's conversion of it: its text model F32, its vision side F32 (the
    converter keeps the projection matrix in F16 whatever the outtype)."""
    folder = save_gemma3_vision(tmp_path_factory.mktemp("gemma3") / "hf", seed=7).path
    return {"folder": folder, "text": llamacpp.convert(folder, folder.parent / "text.gguf", "f32"),
            "mmproj": llamacpp.convert(folder, folder.parent / "mmproj.gguf", "f32", extra_args=("--mmproj",))}


def test_a_gemma3_mmproj_is_the_folders_vision_side(gemma3: dict[str, Path]) -> None:
    vision, processing = load_mmproj(gemma3["mmproj"])
    assert isinstance(vision, Gemma3Vision) and vision.config.image_seq_len == 4
    folder_processing = Gemma3Processing.from_folder(gemma3["folder"])
    assert processing == folder_processing
    pixels = np.random.default_rng(8).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    tiles = torch.from_numpy(processing.normalize(processing.prepare(pixels).tiles))
    expected = load_gemma3_vision(gemma3["folder"]).encode(tiles)
    torch.testing.assert_close(vision.encode(tiles), expected, atol=1e-2, rtol=1e-2)  # the F16 projection


def test_a_gemma3_gguf_with_its_mmproj_answers_as_the_folder_does(gemma3: dict[str, Path]) -> None:
    from PIL import Image

    from pagegate.engine.llm import LLM
    from pagegate.engine.sampling.params import SamplingParams

    image = Image.fromarray(np.random.default_rng(9).integers(0, 256, (90, 120, 3), dtype=np.uint8))
    prompt = {"prompt": "<start_of_turn>user\nLook:<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n",
              "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    answers = []
    for model, mmproj in ((str(gemma3["folder"]), None), (str(gemma3["text"]), str(gemma3["mmproj"]))):
        llm = LLM(model, mmproj=mmproj, device="cpu", num_kv_blocks=32, max_model_len=512, kv_cache_dtype="float32")
        answers.append(llm.generate(prompt, params, use_tqdm=False)[0])
        llm.shutdown()
    folder_answer, gguf_answer = answers
    assert gguf_answer.prompt_token_ids == folder_answer.prompt_token_ids
    assert gguf_answer.outputs[0].token_ids == folder_answer.outputs[0].token_ids
    assert llm.engine.runner.model_config.vision == "gemma3"
