"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig
from pagegate.engine.engine import Engine
from pagegate.engine.errors import RequestFailedError
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.params import SamplingParams
from pagegate.engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """A model folder (or the embedded default model when `model` is None) behind a paged KV cache."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 0.0, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 preemption_mode: str | None = None, watermark: float = 0.01, seed: int = 0,
                 served_model_name: str | None = None) -> None:
        cache = CacheConfig(block_size, num_kv_blocks, kv_cache_memory, gpu_memory_utilization, swap_space,
                            enable_prefix_caching, watermark)
        scheduler = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode)
        self.engine = Engine(EngineConfig(model, served_model_name, dtype, device, seed, cache=cache,
                                          scheduler=scheduler))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine, llm._ids = Engine(config), itertools.count()
        return llm

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            ids.append(str(next(self._ids)))
            self.engine.add_request(ids[-1], prompt, p, priority[i] if priority else 0)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> RequestOutput:
        """One conversation rendered with the model's chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError("this model has no chat template")
        return self.generate(tokenizer.apply_chat_template(messages), sampling_params, use_tqdm)[0]

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

    def stats(self) -> dict:
        return self.engine.stats()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
