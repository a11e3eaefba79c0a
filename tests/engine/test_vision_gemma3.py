"""Images in prompts of a tiny Gemma 3 (its image tokens see each other): transformers' greedy tokens; the same
logprob bits alone, in a batch, in chunks that would cut the image, after a prefix hit and after preemption."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pagegate import LLM, SamplingParams
from pagegate.engine.outputs import RequestOutput

from .conftest import SavedModel, hf
from .vision_models import GEMMA3_SEQ_LEN, save_gemma3_vision

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
LEAD = "Here is a picture of something I saw on my walk today, please look at it closely:"
Answer = tuple[list[int], list[tuple[float, dict[int, float]]]]


def picture(seed: int, height: int = 90, width: int = 120) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision"), seed=5)


@pytest.fixture(scope="module")
def processor(gemma3: SavedModel) -> Any:
    transformers: Any = hf()
    return transformers.AutoProcessor.from_pretrained(gemma3.path)


@pytest.fixture(scope="module")
def texts(processor: Any) -> dict[str, str]:
    def render(*parts: str | None) -> str:
        content = [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]
        return str(processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))

    return {"one": render(LEAD, None, "What is this?"), "two": render("Compare", None, "with", None, "please."),
            "text": render("Tell me a story about a walk in the park.")}


def make(gemma3: SavedModel, **kwargs: Any) -> LLM:
    return LLM(str(gemma3.path), device="cpu", **{"num_kv_blocks": 64, "max_model_len": 512, **kwargs})


def run(llm: LLM, prompts: list[Any], params: SamplingParams = WITH_LOGPROBS) -> list[RequestOutput]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    return outputs


def answer(output: RequestOutput) -> Answer:
    out = output.outputs[0]
    assert out.logprobs is not None and len(out.token_ids) == MAX_TOKENS
    return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]


def probe(texts: dict[str, str], image: Image.Image | None = None) -> dict[str, Any]:
    return {"prompt": texts["one"], "multi_modal_data": {"image": image or picture(0)}}


@pytest.fixture(scope="module")
def alone(gemma3: SavedModel, texts: dict[str, str]) -> Answer:
    llm = make(gemma3, enable_prefix_caching=False)
    return answer(run(llm, [probe(texts)])[0])


@pytest.mark.parametrize("case", ["one", "two"])
def test_greedy_matches_transformers(gemma3: SavedModel, processor: Any, texts: dict[str, str], case: str) -> None:
    images = [picture(0)] if case == "one" else [picture(1, 60, 140), picture(2, 100, 50)]
    inputs = processor(text=texts[case], images=[images], return_tensors="pt")
    model: Any = gemma3.hf_model
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    prompt = inputs["input_ids"][0].tolist()
    llm = make(gemma3, kv_cache_dtype="float32", enable_prefix_caching=False)
    output = run(llm, [{"prompt": texts[case], "multi_modal_data": {"image": images}}], GREEDY)[0]
    assert output.prompt_token_ids == prompt
    assert prompt.count(llm.engine.runner.model_config.image_token_id) == GEMMA3_SEQ_LEN * len(images)
    assert output.outputs[0].token_ids == out[0, len(prompt):].tolist()


def test_the_same_bits_in_a_batch_in_chunks_and_after_a_prefix_hit(gemma3: SavedModel, texts: dict[str, str],
                                                                   alone: Answer) -> None:
    beside = [{"prompt": texts["text"]}, {"prompt": texts["two"], "multi_modal_data": {"image": [picture(6),
                                                                                                 picture(7)]}}]
    batched = make(gemma3, enable_prefix_caching=False)
    assert answer(run(batched, [beside[0], probe(texts), beside[1]])[1]) == alone
    # steps of 5 tokens would cut images (of 4): each is computed whole in a step with room for it (5 holds an image
    # beside the other sequence's decode)
    chunked = make(gemma3, enable_prefix_caching=False, max_num_batched_tokens=5, max_num_seqs=2)
    assert answer(run(chunked, [probe(texts), *beside])[0]) == alone
    cached = make(gemma3)
    first, second = run(cached, [probe(texts)])[0], run(cached, [probe(texts)])[0]
    assert second.num_cached_tokens > 0 and answer(first) == answer(second) == alone


def test_a_step_budget_without_room_for_an_image_beside_every_decode_is_refused(gemma3: SavedModel) -> None:
    with pytest.raises(ValueError, match="must be at least 5, not 4"):
        make(gemma3, max_num_batched_tokens=4, max_num_seqs=2)


def test_another_image_gives_another_answer(gemma3: SavedModel, texts: dict[str, str], alone: Answer) -> None:
    llm = make(gemma3)
    run(llm, [probe(texts)])
    assert answer(run(llm, [probe(texts, picture(9))])[0]) != alone


def test_the_torch_forward_agrees(gemma3: SavedModel, texts: dict[str, str], alone: Answer,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
    llm = make(gemma3, enable_prefix_caching=False)
    assert llm.engine.runner.native is None
    tokens, logprobs = answer(run(llm, [probe(texts)])[0])
    assert tokens == alone[0]
    assert np.allclose([lp for lp, _ in logprobs], [lp for lp, _ in alone[1]], atol=2e-2)
