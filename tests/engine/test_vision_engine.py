"""Images in prompts through the offline engine on a tiny SmolVLM: transformers' greedy tokens, the same logprob bits
alone, in a batch, chunked through an image and after a prefix hit; another image is never a hit; the encoder runs
once per image while its rows stay cached; the torch forward agrees; bad inputs leave nothing behind."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, EngineConfig, KVEventsConfig, SchedulerConfig
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.media.images import ImageLimits, image_from_pil
from pagegate.engine.observe.monitor import start_kv_events
from pagegate.engine.outputs import RequestOutput

from .conftest import SavedModel, hf
from .vision_models import save_smolvlm

BLOCK = 16
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
LEAD = "Here is a picture of something I saw on my walk today, please look at it closely:"  # two pages of text first
Answer = tuple[list[int], list[tuple[float, dict[int, float]]]]


def picture(seed: int, height: int = 150, width: int = 200) -> Image.Image:
    """A random RGB image; 150 x 200 is cut into 2 x 2 tiles and a global one (80 image tokens)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat(*parts: str | None) -> list[dict[str, Any]]:
    """One user message: text parts, and None where an image goes."""
    content = [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_smolvlm(tmp_path_factory.mktemp("smolvlm"), seed=3)


@pytest.fixture(scope="module")
def processor(smolvlm: SavedModel) -> Any:
    transformers: Any = hf()
    return transformers.AutoProcessor.from_pretrained(smolvlm.path)


@pytest.fixture(scope="module")
def texts(processor: Any) -> dict[str, str]:
    """Prompt texts as the chat template writes them, `<image>` where each image goes."""
    def render(*parts: str | None) -> str:
        return str(processor.apply_chat_template(chat(*parts), add_generation_prompt=True))

    return {"one": render(LEAD, None, "What is this?"), "two": render("Compare", None, "with", None, "please."),
            "text": render("Tell me a story about a walk in the park."), "short": render(None, "Colors?"),
            "story": render(" ".join(["Tell me a story about a walk in the park."] * 11))}


def make(smolvlm: SavedModel, **kwargs: Any) -> LLM:
    return LLM(str(smolvlm.path), device="cpu", **{"num_kv_blocks": 96, "max_model_len": 1024, **kwargs})


@pytest.fixture(scope="module")
def exact(smolvlm: SavedModel) -> LLM:
    """float32 pages (the CPU default is int8): held to transformers' greedy tokens."""
    return make(smolvlm, kv_cache_dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cold(smolvlm: SavedModel) -> LLM:
    return make(smolvlm, enable_prefix_caching=False)


def probe(texts: dict[str, str], image: Image.Image | None = None) -> dict[str, Any]:
    """The request whose bits are compared: the lead text, the split image, a question."""
    return {"prompt": texts["one"], "multi_modal_data": {"image": image or picture(0)}}


def beside(texts: dict[str, str]) -> list[dict[str, Any]]:
    """Other requests in the same steps: text alone, another image (3 tiles), two images."""
    return [{"prompt": texts["text"]},
            {"prompt": texts["short"], "multi_modal_data": {"image": picture(5, 40, 250)}},
            {"prompt": texts["two"], "multi_modal_data": {"image": [picture(6, 90, 90), picture(7, 200, 60)]}}]


def run(llm: LLM, prompts: list[Any], params: SamplingParams = WITH_LOGPROBS) -> list[RequestOutput]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    return outputs


def answer(output: RequestOutput) -> Answer:
    out = output.outputs[0]
    assert out.logprobs is not None and len(out.token_ids) == MAX_TOKENS
    return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]


def image_span(output: RequestOutput, llm: LLM) -> tuple[int, int]:
    """[first, last + 1) of the prompt's image tokens, as the engine tokenized it."""
    return image_span_of(output.prompt_token_ids, llm)


def image_span_of(prompt: list[int], llm: LLM) -> tuple[int, int]:
    image_token = llm.engine.runner.model_config.image_token_id
    positions = [p for p, t in enumerate(prompt) if t == image_token]
    return positions[0], positions[-1] + 1


@pytest.fixture(scope="module")
def alone(cold: LLM, texts: dict[str, str]) -> Answer:
    return answer(run(cold, [probe(texts)])[0])


# --- against transformers ----------------------------------------------------------------------------------------

def hf_greedy(smolvlm: SavedModel, processor: Any, text: str, images: list[Image.Image]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' Idefics3 on its processor's inputs."""
    inputs = processor(text=text, images=[images], return_tensors="pt")
    model: Any = smolvlm.hf_model
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             pad_token_id=1)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["split_image", "two_images"])
def test_greedy_matches_transformers(smolvlm: SavedModel, processor: Any, texts: dict[str, str], exact: LLM,
                                     case: str) -> None:
    text, images = ((texts["one"], [picture(0)]) if case == "split_image" else
                    (texts["two"], [picture(1, 100, 140), picture(2, 40, 250)]))
    prompt, expected = hf_greedy(smolvlm, processor, text, images)
    output = run(exact, [{"prompt": text, "multi_modal_data": {"image": images}}], GREEDY)[0]
    assert output.prompt_token_ids == prompt
    assert output.outputs[0].token_ids == expected
    tiles = sum(len(processor.image_processor(image)["pixel_values"][0]) for image in images)
    assert prompt.count(exact.engine.runner.model_config.image_token_id) == 16 * tiles
    assert tiles >= (5 if case == "split_image" else 4)


# --- the same bits every way -------------------------------------------------------------------------------------

def test_in_a_batch_with_text_and_other_images(cold: LLM, texts: dict[str, str], alone: Answer) -> None:
    outputs = run(cold, [*beside(texts)[:2], probe(texts), beside(texts)[2]])
    assert answer(outputs[2]) == alone
    assert answer(run(cold, [probe(texts), *beside(texts)])[0]) == alone


def test_in_a_step_the_native_decoder_cuts_through_the_image(cold: LLM, texts: dict[str, str],
                                                             alone: Answer) -> None:
    """A step of more tokens than the native kernel takes runs as consecutive calls (models/native.py): here a
    long text prompt before the probe puts one call's end inside the probe's image rows."""
    native = cold.engine.runner.native
    assert native is not None
    outputs = run(cold, [{"prompt": texts["story"]}, probe(texts)])
    first, end = image_span(outputs[1], cold)
    offset = len(outputs[0].prompt_token_ids)  # both prompts are prefilled in the first step
    assert offset + first < native.max_tokens < offset + end <= cold.engine.runner.config.scheduler.step_tokens
    assert answer(outputs[1]) == alone


def test_prefilled_in_chunks_that_cut_the_image(smolvlm: SavedModel, texts: dict[str, str], alone: Answer) -> None:
    chunk = 24
    llm = make(smolvlm, enable_prefix_caching=False, max_num_batched_tokens=chunk)
    output = run(llm, [probe(texts)])[0]
    first, end = image_span(output, llm)
    assert len([cut for cut in range(chunk, end, chunk) if cut > first]) >= 3  # chunk edges inside the image's rows
    assert answer(output) == alone
    assert answer(run(llm, [*beside(texts), probe(texts)])[-1]) == alone  # and beside others' chunks and decodes


def test_after_a_prefix_hit_whose_tail_holds_image_rows(smolvlm: SavedModel, texts: dict[str, str],
                                                        alone: Answer) -> None:
    llm = make(smolvlm)
    first = run(llm, [probe(texts)])[0]
    second = run(llm, [probe(texts)])[0]
    start, end = image_span(second, llm)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(second.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert start < second.num_cached_tokens < end  # the hit covers the image's first rows, the tail its last ones
    assert answer(first) == answer(second) == alone


def test_another_image_is_no_hit_past_the_page_where_it_starts(smolvlm: SavedModel, texts: dict[str, str],
                                                               alone: Answer) -> None:
    llm = make(smolvlm)
    run(llm, [probe(texts)])
    other = run(llm, [probe(texts, picture(1))])[0]
    start, _ = image_span(other, llm)
    assert start >= 2 * BLOCK  # the lead text fills two pages before the image's page
    assert other.num_cached_tokens == start // BLOCK * BLOCK
    assert answer(other) != alone
    again = run(llm, [probe(texts)])[0]  # the first image's pages are still its own
    assert again.num_cached_tokens > start and answer(again) == alone


def test_recomputed_after_preemption(smolvlm: SavedModel, texts: dict[str, str], alone: Answer) -> None:
    """Three image prompts fill a small pool; the last is preempted, its pages dropped, and its prompt (the image's
    rows given again, from the encoder's cache) recomputed later."""
    llm = make(smolvlm, enable_prefix_caching=False, num_kv_blocks=30, max_model_len=256,
               preemption_mode="recompute")
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    outputs = run(llm, [probe(texts, picture(40)), probe(texts, picture(41)), probe(texts)], params)
    assert [bool(o.metrics.get("preemptions")) for o in outputs] == [False, False, True]
    out = outputs[-1].outputs[0]
    assert out.logprobs is not None
    assert (out.token_ids[:MAX_TOKENS], [(lp.logprob, lp.top) for lp in out.logprobs[:MAX_TOKENS]]) == alone
    images = llm.engine.runner.images
    assert images is not None and images.encoded == 3


def test_kv_events_name_the_images_of_the_pages_that_hold_them(smolvlm: SavedModel, texts: dict[str, str]) -> None:
    """A stored page whose tokens belong to an image carries that image's digest in extra_keys (vLLM's multimodal
    hash) and the prompt's own tokens (the placeholders, not the prefix cache's keys); pages of text alone carry
    none; the same page structure under another image names the other image."""
    import msgpack
    import zmq

    from pagegate.testing.launcher import free_port

    port, topic = free_port(), "kv@vision"
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.bind(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, topic.encode())
    llm = make(smolvlm)
    llm.engine.monitor.kv_events = start_kv_events(
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
                       replay_endpoint=None, topic=topic), llm.engine.scheduler.pool)

    def stored() -> list[tuple[list[int], list[str] | None]]:
        pages = []
        while subscriber.poll(300):
            for event in msgpack.unpackb(subscriber.recv_multipart()[2])[1]:
                if event[0] == "BlockStored":
                    images = event[8] if len(event) > 8 else [None] * len(event[1])
                    pages += [(event[3][i * BLOCK:(i + 1) * BLOCK], images[i]) for i in range(len(event[1]))]
        return pages

    try:
        assert stored() == []  # waits for the connection: PUB drops what is sent before it
        pages = {}
        for seed in (0, 1):
            output = run(llm, [probe(texts, picture(seed))], GREEDY)[0]
            pages[seed] = (output.prompt_token_ids, output.num_cached_tokens, stored())
    finally:
        llm.shutdown()
        context.destroy(linger=0)
    for seed, (prompt, hit, seen) in pages.items():
        digest = image_from_pil(picture(seed), "image", ImageLimits()).digest.hex()
        start, end = image_span_of(prompt, llm)
        assert hit == (2 * BLOCK if seed else 0)  # the second prompt's lead text is a hit, its image no page of it
        assert hit + len(seen) * BLOCK >= end and [t for tokens, _ in seen for t in tokens] == prompt[hit:][
            :len(seen) * BLOCK]
        for page, (_, images) in enumerate(seen, start=hit // BLOCK):
            holds_image = page * BLOCK < end and (page + 1) * BLOCK > start
            assert images == ([digest] if holds_image else None), (seed, page)
    assert pages[0][0] == pages[1][0]  # the same prompt tokens: only the digests tell the images apart


# --- the encoder -------------------------------------------------------------------------------------------------

def test_the_encoder_runs_once_per_image_while_its_rows_stay_cached(smolvlm: SavedModel,
                                                                    texts: dict[str, str]) -> None:
    llm = make(smolvlm, enable_prefix_caching=False)  # every request needs all its rows
    images = llm.engine.runner.images
    assert images is not None and images.encoded == 0
    a, b = picture(20), picture(21)
    run(llm, [probe(texts, a)])
    assert images.encoded == 1
    run(llm, [probe(texts, a), probe(texts, a)])
    assert images.encoded == 1
    run(llm, [probe(texts, b), probe(texts, a), probe(texts, b)])
    assert images.encoded == 2


def test_the_encoder_runs_again_once_its_rows_are_evicted(smolvlm: SavedModel, texts: dict[str, str],
                                                          cold: LLM) -> None:
    """Rows for two and a half images: the least recently used image's rows go first, and come back encoded again."""
    model: Any = smolvlm.hf_model
    rows_bytes = 80 * int(model.config.text_config.hidden_size) * 4  # an image of 5 tiles: float32 rows
    config = EngineConfig(str(smolvlm.path), device="cpu", image_cache_memory=2 * rows_bytes + rows_bytes // 2,
                          cache=CacheConfig(num_kv_blocks=96, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_model_len=1024))
    llm = LLM.from_config(config)
    images = llm.engine.runner.images
    assert images is not None
    a, b, c = picture(30), picture(31), picture(32)
    order = (a, b, a, c, a, b)  # c pushes b out (a was used since), then b pushes c out
    outputs, encoded = [], []
    for image in order:
        outputs.append(answer(run(llm, [probe(texts, image)])[0]))
        encoded.append(images.encoded)
    assert encoded == [1, 2, 2, 3, 3, 4]
    assert images.cached_bytes == 2 * rows_bytes
    assert outputs == [answer(run(cold, [probe(texts, image)])[0]) for image in order]


# --- the torch forward -------------------------------------------------------------------------------------------

def test_the_torch_forward_gives_the_native_tokens(smolvlm: SavedModel, texts: dict[str, str], cold: LLM,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [probe(texts), beside(texts)[2]]
    native = [o.outputs[0].token_ids for o in run(cold, prompts, GREEDY)]
    monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
    reference = make(smolvlm, enable_prefix_caching=False)
    assert cold.engine.runner.native is not None and reference.engine.runner.native is None
    assert [o.outputs[0].token_ids for o in run(reference, prompts, GREEDY)] == native


# --- bad input ---------------------------------------------------------------------------------------------------

def _refused(llm: LLM, prompts: list[Any], error: type[Exception] = ValueError, match: str = "") -> Exception:
    with pytest.raises(error, match=match) as caught:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.stats().used_blocks == 0
    return caught.value


def test_bad_images_are_refused_before_anything_is_queued(cold: LLM, texts: dict[str, str]) -> None:
    good = probe(texts)
    two = {"prompt": texts["two"], "multi_modal_data": {"image": picture(0)}}
    error = _refused(cold, [good, two], InvalidParamError, "2 image placeholder")
    assert isinstance(error, InvalidParamError) and error.param == "prompt"
    _refused(cold, [{"prompt": texts["one"], "multi_modal_data": {"image": [picture(0), picture(1)]}}],
             InvalidParamError, "1 image placeholder")
    _refused(cold, [good, {"prompt": texts["one"], "multi_modal_data": {"audio": b"RIFF"}}], match="modality")
    _refused(cold, [{"prompt": texts["one"]}], InvalidParamError, "image tokens")  # <image> as text, no image
    _refused(cold, [{"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": picture(0)}}],
             match="text prompt")
    error = _refused(cold, [{"prompt": texts["one"], "multi_modal_data": {"image": np.zeros((8, 8, 3))}}],
                     InvalidParamError, "PIL")
    assert isinstance(error, InvalidParamError) and error.param == "multi_modal_data.image.0"
    assert answer(run(cold, [good])[0])  # and the engine still serves


def test_a_text_only_model_refuses_an_image() -> None:
    llm = LLM(None, device="cpu", num_kv_blocks=16, max_model_len=256)
    assert llm.engine.runner.images is None
    _refused(llm, ["hello", {"prompt": "<image> what is it?", "multi_modal_data": {"image": picture(0)}}],
             match="does not take images")
    assert run(llm, ["hello"], GREEDY)[0].outputs[0].token_ids


def test_chat_takes_image_parts_as_generate_takes_multi_modal_data(exact: LLM, texts: dict[str, str]) -> None:
    """`LLM.chat` reads OpenAI's image_url parts (a data: URL) and vLLM's image_pil parts, and renders, places and
    answers them as `generate` does the template's text with the image."""
    import base64
    import io

    image = picture(0)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    expected = exact.generate(probe(texts, image), GREEDY, use_tqdm=False)[0]
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_pil", "image_pil": image}):
        messages = [{"role": "user", "content": [{"type": "text", "text": LEAD}, part,
                                                 {"type": "text", "text": "What is this?"}]}]
        answer = exact.chat(messages, GREEDY, use_tqdm=False)[0]
        assert answer.prompt_token_ids == expected.prompt_token_ids
        assert answer.outputs[0].token_ids == expected.outputs[0].token_ids
