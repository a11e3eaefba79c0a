"""A prefix-cache hit gives what a cold run gives, bit for bit, on sliding-window models (issue 41, item 6): a tiny
Gemma 3 (five window layers in six, two RoPE tables) and a tiny Mistral, a prompt of eight windows, pages small
enough that the window spans three of them, from the Hugging Face folder (float32) and Gemma 3 from a Q8_0 GGUF.

Before, the prompt tokens a hit leaves ran in another step shape than in the cold prefill: float rounding apart in
float32 (1e-5 in log-probabilities), and on the Q8_0 file the native step's Q8-rounded activations where the cold
prefill had float32 ones: the greedy answers parted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.engine.outputs import RequestOutput

from .conftest import TINY, SavedModel, hf, save_hf_model
from .family_models import FAMILIES, convert

WINDOW = 12
BLOCK = 4  # the window spans three pages
PROMPT = 100  # eight windows; a hit covers 96 tokens and leaves 4 to compute
TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=1)


def save_model(name: str, folder: Path) -> SavedModel:
    """A random tiny `name` ("gemma3" or "mistral") whose window spans WINDOW tokens."""
    if name == "mistral":
        return save_hf_model(folder, hf().MistralConfig(**TINY, sliding_window=WINDOW), seed=4)
    make_config, save_tokenizer = FAMILIES["gemma3"]
    save_tokenizer(folder)
    config = make_config(len(hf().AutoTokenizer.from_pretrained(folder)))
    config.sliding_window = WINDOW
    saved = save_hf_model(folder, config, seed=11)
    save_tokenizer(folder)  # save_pretrained wrote its own generation_config.json
    return saved


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gemma3_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 in Q8_0 blocks, as llama.cpp's converter writes it (a GGUF of Mistral, llama.cpp's llama
    architecture, carries no window)."""
    saved = save_model("gemma3", tmp_path_factory.mktemp("gemma3-q8"))
    return convert(saved, tmp_path_factory.mktemp("gguf"), "q8_0")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    """Token ids every model here has (the byte-level Mistral's vocabulary is the smaller)."""
    return torch.randint(3, TINY["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


def cold_then_hit(path: Path, prompt: list[int]) -> tuple[RequestOutput, RequestOutput]:
    """The same greedy request twice on one engine: cold, then served from the prefix cache."""
    llm = LLM(str(path), device="cpu", block_size=BLOCK, num_kv_blocks=128, max_model_len=256,
              kv_cache_dtype="float32")  # by name: the float32 test holds it to transformers' tokens
    window = llm.engine.runner.model_config.sliding_window
    assert window == WINDOW and window < PROMPT and window > 2 * BLOCK
    cold, hit = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert cold.num_cached_tokens == 0
    assert hit.num_cached_tokens == (PROMPT - 1) // BLOCK * BLOCK
    return cold, hit


def assert_same_answer(cold: RequestOutput, hit: RequestOutput) -> None:
    """The same tokens with the same log-probabilities, bit for bit: the hit's rest of the prompt is computed in
    the step shape the cold run computed it in (scheduler.py, _hit_end), over the very pages it wrote."""
    a, b = cold.outputs[0], hit.outputs[0]
    assert b.token_ids == a.token_ids
    assert a.logprobs is not None and b.logprobs is not None
    assert [x.logprob for x in b.logprobs] == [x.logprob for x in a.logprobs]


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=TOKENS,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_float32_hit_equals_cold_and_transformers(family: SavedModel, prompt: list[int]) -> None:
    """The window's boundary, its pages and Gemma 3's local and global RoPE tables on a hit."""
    cold, hit = cold_then_hit(family.path, prompt)
    assert cold.outputs[0].token_ids == hf_greedy(family.hf_model, prompt)
    assert_same_answer(cold, hit)


def test_q8_gguf_hit_equals_cold(gemma3_q8: Path, prompt: list[int]) -> None:
    """The 4 prompt tokens a hit leaves are computed as the cold run computed them; before, they ran on the native
    step's Q8 activations where the cold prefill had float32 ones, and the greedy answers parted."""
    cold, hit = cold_then_hit(gemma3_q8, prompt)
    assert_same_answer(cold, hit)
