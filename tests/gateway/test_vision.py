"""Images through every chat API, against a real server running a tiny random SmolVLM: the official openai and
anthropic SDKs send them; greedy answers equal transformers' own generate on the same image and prompt; the same
image twice is a prefix hit; bad images are 400s naming the part."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from pagegate.testing.launcher import ServerProcess
from tests.engine.vision_models import save_smolvlm
from tests.gateway.server_args import server_args

QUESTION = "What is in this picture?"
MAX_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


def _picture(seed: int, size: tuple[int, int] = (200, 300)) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_smolvlm(tmp_path_factory.mktemp("smolvlm")).path


@pytest.fixture(scope="module")
def vision_server(vlm: Path):
    args = server_args("--served-model-name", "smolvlm", "--num-kv-blocks", "96", "--max-model-len", "1024",
                       "--max-num-seqs", "4",
                       "--limit-mm-per-prompt", '{"image": 2}', embedded=True)
    process = ServerProcess(["--model", str(vlm), *args]).start()
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def vision_client(vision_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=vision_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _expected(folder: Path, image: Image.Image) -> str:
    """transformers' greedy answer to QUESTION about `image` (its own processor, template and generate)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _chat(client: openai.OpenAI, url: str, **extra: object) -> openai.types.chat.ChatCompletion:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(model="smolvlm", messages=[{"role": "user", "content": content}],
                                          extra_body={"ignore_eos": True}, **GREEDY, **extra)


def test_every_api_answers_as_transformers_does(vlm: Path, vision_server: ServerProcess,
                                                 vision_client: openai.OpenAI) -> None:
    image = _picture(0)
    expected = _expected(vlm, image)
    url = _data_url(_png(image))
    chat = _chat(vision_client, url)
    assert chat.choices[0].message.content == expected
    claude = anthropic.Anthropic(base_url=vision_server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="smolvlm", max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(_png(image)).decode()}},
            {"type": "text", "text": QUESTION}]}], extra_body={"temperature": 0.0})
    assert message.content[0].text == expected
    response = vision_client.responses.create(model="smolvlm", max_output_tokens=MAX_TOKENS, temperature=0.0,
                                              input=[{"role": "user", "content": [
                                                  {"type": "input_image", "image_url": url, "detail": "auto"},
                                                  {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected


def test_the_same_image_is_a_prefix_hit_and_another_is_not(vision_client: openai.OpenAI) -> None:
    first = _chat(vision_client, _data_url(_png(_picture(1))))
    again = _chat(vision_client, _data_url(_png(_picture(1))))
    other = _chat(vision_client, _data_url(_png(_picture(2))))
    prompt = first.usage.prompt_tokens
    assert again.usage.prompt_tokens == prompt == other.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt - 16  # all but the last, partial page
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # its first page starts the image's keys
    assert again.choices[0].message.content == first.choices[0].message.content


def test_an_image_sent_as_jpeg_or_png_of_the_same_pixels_is_the_same_image(vision_client: openai.OpenAI) -> None:
    image = _picture(3)
    lossless = io.BytesIO()
    image.save(lossless, format="WEBP", lossless=True)
    png = _chat(vision_client, _data_url(_png(image)))
    webp = _chat(vision_client, _data_url(lossless.getvalue(), "image/webp"))
    assert webp.usage.prompt_tokens_details.cached_tokens >= png.usage.prompt_tokens - 16
    assert webp.choices[0].message.content == png.choices[0].message.content


@pytest.mark.parametrize(("url", "says"), [
    ("data:text/plain;base64,aGVsbG8=", "text/plain"),
    (_data_url(_png(_picture(4))[:200]), "truncated"),
    (_data_url(_png(_picture(4)), "image/jpeg"), "PNG"),
    ("http://example.com/cat.png", "allowed-media-domains"),
    ("file:///etc/passwd", "file"),
])
def test_bad_images_are_400s_naming_the_part(vision_client: openai.OpenAI, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(vision_client, url)
    error = caught.value.body
    assert error["param"] == "messages.0.content.0.image_url", error
    assert says.lower() in error["message"].lower(), error


def test_more_images_than_the_limit_are_a_400(vision_client: openai.OpenAI) -> None:
    url = _data_url(_png(_picture(5, (40, 40))))
    content = [{"type": "image_url", "image_url": {"url": url}} for _ in range(3)]
    with pytest.raises(openai.BadRequestError) as caught:
        vision_client.chat.completions.create(model="smolvlm", messages=[{"role": "user", "content": content}],
                                              max_tokens=1)
    assert "3" in caught.value.body["message"] and "2" in caught.value.body["message"]


def test_images_only_in_user_messages(vision_client: openai.OpenAI) -> None:
    url = _data_url(_png(_picture(6, (40, 40))))
    with pytest.raises(openai.BadRequestError) as caught:
        vision_client.chat.completions.create(model="smolvlm", max_tokens=1, messages=[
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": url}}]},
            {"role": "user", "content": "hi"}])
    assert caught.value.body["param"].startswith("messages.0.content")


def test_a_text_model_refuses_images(client: openai.OpenAI, model: str) -> None:
    url = _data_url(_png(_picture(7, (40, 40))))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}])
    assert caught.value.body["param"] == "messages.0.content.0.image_url"
    assert "does not take images" in caught.value.body["message"]


def test_gemma3_answers_as_transformers_does_through_the_sdks(tmp_path: Path) -> None:
    """The second family, served: Gemma 3's preprocessing crosses to the engine core (its image tokens see each
    other), and the openai and anthropic SDKs get transformers' greedy answer."""
    import transformers

    from tests.engine.vision_models import save_gemma3_vision

    folder = save_gemma3_vision(tmp_path / "gemma3", seed=2).path
    image = _picture(3, (90, 120))
    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    # the template writes the BOS: the tokenizer adds none (as a served chat's prompt; the processor's own call on
    # the rendered text would add a second)
    inputs = processor(text=processor.apply_chat_template(messages, add_generation_prompt=True), images=[image],
                       return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    args = server_args("--served-model-name", "gemma3", "--num-kv-blocks", "64", "--max-model-len", "512",
                       embedded=True)
    server = ServerProcess(["--model", str(folder), *args]).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        content = [{"type": "image_url", "image_url": {"url": _data_url(_png(image))}},
                   {"type": "text", "text": QUESTION}]
        chat = client.chat.completions.create(model="gemma3", messages=[{"role": "user", "content": content}],
                                              extra_body={"ignore_eos": True}, **GREEDY)
        assert chat.choices[0].message.content == expected
        assert chat.usage.prompt_tokens == inputs["input_ids"].shape[1]
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
        message = claude.messages.create(model="gemma3", max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(_png(image)).decode()}},
                {"type": "text", "text": QUESTION}]}], extra_body={"temperature": 0.0})
        assert message.stop_reason == "max_tokens"  # no end of turn in 6 tokens: the same tokens as above
        assert message.content[0].text == expected
    finally:
        assert server.stop() == 0, server.log()[-4000:]
