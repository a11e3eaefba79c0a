"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))` and `LLM(...).chat(messages)`, shaped
like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict, cast

from tqdm import tqdm

from pagegate.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from pagegate.engine.engine import Engine
from pagegate.engine.errors import RequestFailedError
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.lora.request import LoRARequest
from pagegate.engine.media.images import DecodedImage, ImageLimits, image_from_pil, image_from_url
from pagegate.engine.media.placement import PlacedImage, place_images, template_parts
from pagegate.engine.observe.stats import EngineStats
from pagegate.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sequence import Request


class TextPrompt(TypedDict):
    """vLLM's text prompt: tokenized with the model's special tokens (usually a BOS)."""

    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]  # {"image": a PIL image or a list}: one per placeholder in `prompt`


class TokensPrompt(TypedDict):
    """vLLM's token prompt: the ids go to the model as they are; `prompt` is only reported back."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


Prompt = str | list[int] | TextPrompt | TokensPrompt
Conversation = list[dict[str, Any]]
Params = SamplingParams | Sequence[SamplingParams] | None

IMAGE_PARTS = ("image_url", "image_pil")  # a chat's image parts: OpenAI's, and vLLM's offline one (a PIL image)
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"})


class LLM:
    """A model folder (or the embedded default model when `model` is None) behind a paged KV cache."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 0.0, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 preemption_mode: str | None = None, watermark: float = 0.01, seed: int = 0,
                 served_model_name: str | None = None, quantization: str | None = None,
                 tensor_parallel_size: int = 1, distributed_timeout_s: float = 60.0,
                 scheduling_policy: str = "fcfs", speculative_config: dict | SpeculativeConfig | None = None,
                 task: str = "generate", pooling: str | None = None, kv_cache_dtype: str = "auto",
                 enable_lora: bool = False, max_loras: int = 4, max_lora_rank: int = 16,
                 mmproj: str | None = None) -> None:
        cache = CacheConfig(block_size, num_kv_blocks, kv_cache_memory, gpu_memory_utilization, swap_space,
                            enable_prefix_caching, watermark, kv_cache_dtype=kv_cache_dtype)
        scheduler = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode,
                                    scheduling_policy=scheduling_policy)
        speculative = (SpeculativeConfig.from_json(speculative_config) if isinstance(speculative_config, dict)
                       else speculative_config)
        self.engine = Engine(EngineConfig(model, served_model_name, dtype, device, seed, quantization,
                                          tensor_parallel_size, distributed_timeout_s, speculative=speculative,
                                          cache=cache, scheduler=scheduler, task=task, pooling=pooling,
                                          lora=LoRAConfig(max_loras, max_lora_rank) if enable_lora else None,
                                          mmproj=mmproj))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine, llm._ids = Engine(config), itertools.count()
        return llm

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts.

        A prompt is text, a list of token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`;
        pass one prompt or a list of them (a flat list of ints is one prompt). `lora_request`: the LoRA adapter
        of every prompt, or one per prompt (None: the base model), as in vLLM.
        """
        return self._generate(_as_prompt_list(prompts), sampling_params, use_tqdm, priority, lora_request)

    def _generate(self, prompts: list[Prompt], sampling_params: Params, use_tqdm: bool,
                  priority: Sequence[int] | None = None,
                  lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                  images: Sequence[list[PlacedImage]] | None = None) -> list[RequestOutput]:
        params = _params_per_prompt(sampling_params, len(prompts))
        loras = _loras_per_prompt(lora_request, len(prompts))
        # every prompt is validated before any is queued: a bad one leaves nothing behind
        requests = [self._make_request(prompt, p, priority[i] if priority else 0, lora=loras[i],
                                       images=images[i] if images else ())
                    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]
        for request in requests:
            self.engine.add(request)
        return self._run([r.request_id for r in requests], use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`task="embed"`, or `pooling` on a generative model), in prompt order; with
        `lora_request` as in `generate`."""
        prompts = _as_prompt_list(prompts)
        loras = _loras_per_prompt(lora_request, len(prompts))
        requests = [self._make_request(prompt, SamplingParams(), 0, embed=True, lora=lora)
                    for prompt, lora in zip(prompts, loras, strict=True)]
        for request in requests:
            self.engine.add(request)
        self._run([r.request_id for r in requests], use_tqdm)
        return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.embedding.tolist()))
                for r in requests if r.embedding is not None]

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: Params = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (the model's, or `chat_template`) and generate.

        One conversation (a list of message dicts) or a list of them; always a list of outputs, like vLLM.
        The prompt ids are those the REST chat endpoint makes for the same messages.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render a chat")
        conversations = _conversations(messages)
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
        if tools is not None:
            kwargs["tools"] = tools
        kwargs.update(chat_template_kwargs or {})  # as in vLLM, these win over the named arguments
        if continue_final_message and kwargs["add_generation_prompt"]:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        processing = self.engine.processing
        token = processing.image_token if processing is not None else ""
        prompts: list[Prompt] = []
        images: list[list[PlacedImage]] = []
        for conversation in conversations:
            pictures = self._chat_images(conversation)
            normalized = [_template_message(m, token) for m in conversation]
            shown = template_parts(normalized, token) if processing is not None else normalized
            text = tokenizer.apply_chat_template(shown, chat_template=chat_template, **kwargs)
            if continue_final_message:
                text = _cut_after_final_message(text, normalized)
            written, placed = place_images(text, pictures, processing, "messages") if processing else (text, [])
            prompts.append(TokensPrompt(prompt_token_ids=tokenizer.encode_chat(written), prompt=text))
            images.append(placed)
        return self._generate(prompts, sampling_params, use_tqdm, images=images)

    def _chat_images(self, conversation: Conversation) -> list[DecodedImage]:
        """The conversation's image parts, decoded: `image_url` (a data: URL) or vLLM's `image_pil` (a PIL image)."""
        found = [(f"messages.{i}.content.{j}", part) for i, message in enumerate(conversation)
                 for j, part in enumerate(_content_parts(message)) if part.get("type") in IMAGE_PARTS]
        if found and self.engine.processing is None:
            param, part = found[0]
            raise ValueError(f"this model does not take images (the {part['type']} part at {param})")
        limits = ImageLimits(max_images=max(len(found), 1))
        return [image_from_pil(part["image_pil"], param, limits) if part["type"] == "image_pil"
                else image_from_url(part["image_url"]["url"], param, limits) for param, part in found]

    def _make_request(self, prompt: Prompt, params: SamplingParams, priority: int, embed: bool = False,
                      lora: LoRARequest | None = None, images: Sequence[PlacedImage] = ()) -> Request:
        text, engine_prompt, salt = _unpack(prompt)
        pictures = _pictures(prompt)
        if pictures is not None:
            text, engine_prompt, images = self._place(engine_prompt, pictures)
        adapter = self.engine.memory.adapter(lora)
        request = self.engine.intake.make_request(str(next(self._ids)), engine_prompt, params, priority, salt,
                                                  embed=embed, lora=adapter, images=images)
        if text is not None:
            request.prompt = text
        return request

    def _place(self, prompt: str | list[int], pictures: list[Any]) -> tuple[str, str, list[PlacedImage]]:
        """(the prompt as written, as the model reads it, its images) of a text prompt with image placeholders."""
        processing = self.engine.processing
        if processing is None:
            raise ValueError("this model does not take images (multi_modal_data)")
        if not isinstance(prompt, str):
            raise ValueError("multi_modal_data goes with a text prompt, whose placeholders the images fill")
        limits = ImageLimits(max_images=max(len(pictures), 1))
        decoded = [image_from_pil(picture, f"multi_modal_data.image.{i}", limits)
                   for i, picture in enumerate(pictures)]
        text, images = place_images(prompt, decoded, processing, "prompt")
        return prompt, text, images

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.error:
                        raise RequestFailedError(f"request {output.request_id}: {output.error}")
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def sleep(self) -> None:
        """Free the KV pages, keep the weights (vLLM's sleep level 1); `generate` refuses until `wake_up`. The
        cached prefixes go with the pages (down the KV tiers first, when they are on)."""
        self.engine.sleep()

    def wake_up(self, kv_bytes: int | None = None) -> int:
        """KV pages again after `sleep` (`kv_bytes` of them; None: as many as before); how many."""
        return self.engine.wake_up(kv_bytes)

    def load_lora_adapter(self, name: str, path: str) -> int:
        """Register the LoRA adapter in `path` (a PEFT folder or a GGUF file) under `name` (`enable_lora`); its id.
        Prompts then name it by `lora_request=LoRARequest(name, id, path)`."""
        return self.engine.load_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget an adapter and give back its pages; a ValueError while requests use it."""
        self.engine.unload_adapter(name)

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (their exit is also automatic when this process ends)."""
        self.engine.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [cast(Prompt, prompts)]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # one prompt of token ids
    return cast(list[Prompt], items)


def _params_per_prompt(sampling_params: Params, count: int) -> list[SamplingParams]:
    params = sampling_params or SamplingParams()
    params = [params] * count if isinstance(params, SamplingParams) else list(params)
    if len(params) != count:
        raise ValueError(f"{count} prompts but {len(params)} sampling params")
    return params


def _loras_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"{count} prompts but {len(loras)} LoRA requests")
    return loras


def _unpack(prompt: Prompt) -> tuple[str | None, str | list[int], str | None]:
    """(text to report, what the engine tokenizes or takes as ids, cache salt) of one prompt."""
    if isinstance(prompt, str):
        return None, prompt, None
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"unsupported prompt field(s) {sorted(unknown)}; use {sorted(_PROMPT_KEYS)}")
        fields: Mapping[str, Any] = prompt
        token_ids, text, salt = fields.get("prompt_token_ids"), fields.get("prompt"), fields.get("cache_salt")
        if token_ids is not None:
            return text, list(token_ids), salt
        if text is not None:
            return None, text, salt
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt), None
    raise TypeError(f"a prompt is a str, a list of token ids or a dict, not {type(prompt).__name__}")


def _pictures(prompt: Prompt) -> list[Any] | None:
    """The PIL images of a prompt's `multi_modal_data` (vLLM's {"image": image or [images]}); None without one."""
    if not isinstance(prompt, Mapping) or "multi_modal_data" not in prompt:
        return None
    data = dict(cast(Mapping[str, Any], prompt)["multi_modal_data"])
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"unsupported multi_modal_data modality {sorted(unknown)}; this engine takes 'image'")
    image = data.get("image")
    return list(image) if isinstance(image, list | tuple) else [image] if image is not None else []


def _conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    if not messages or isinstance(messages[0], Mapping):
        return [cast(Conversation, messages)]
    return [cast(Conversation, conversation) for conversation in messages]


def _content_parts(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _template_message(message: Mapping[str, Any], image_token: str = "") -> dict[str, Any]:
    """A message as the REST chat endpoint hands it to the template: text parts joined (image parts as
    `image_token`), developer as system."""
    content = message.get("content")
    if isinstance(content, list):
        kinds = {part.get("type") for part in content} - {"text", *IMAGE_PARTS}
        if kinds:
            raise ValueError(f"content parts of type {sorted(kinds)} are not supported; only 'text', 'image_url' "
                             "and 'image_pil'")
        content = "".join(part["text"] if part.get("type") == "text" else image_token for part in content)
    role = message["role"]
    return {**message, "role": "system" if role == "developer" else role, "content": content}


def _cut_after_final_message(text: str, messages: Conversation) -> str:
    """The rendered chat up to the end of the last message's content, so generation continues it
    (transformers' continue_final_message; some templates strip the content, so try it stripped too)."""
    final = messages[-1]["content"] if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    for piece in (final, final.strip()):
        end = text.rfind(piece)
        if end >= 0:
            return text[:end + len(piece)]
    raise ValueError("the chat template does not render the final message's content verbatim")
