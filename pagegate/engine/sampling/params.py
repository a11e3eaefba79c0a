"""Per-request sampling parameters (field names follow vLLM's SamplingParams)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagegate.engine.errors import InvalidParamError

if TYPE_CHECKING:
    from pagegate.engine.sampling.structured import StructuredOutputsParams

# Below this temperature a request samples greedily: dividing logits by a vanishing temperature
# overflows float32, and the limit of softmax(logits / t) as t -> 0 is the argmax (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# repetition_penalty divides positive logits and multiplies negative ones; outside this range the
# text is degenerate and, near 0 (5e-324 is 0 in float32), the logits overflow to inf and NaN.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Per-request list bounds: each list is walked when the request arrives, so a huge one must not get in.
MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
MAX_STOP_TOKEN_IDS = 256
# Request priorities (lower runs first). Waiting requests gain SchedulerConfig.aging_rate levels a second, so
# with a bounded range a request waits at most (range width / aging_rate) seconds behind later, more urgent ones.
PRIORITY_RANGE = (-100, 100)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the stop string or stop token that ended a choice
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None  # score the prompt: each token's logprob and this many top alternatives
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this grammar
    grammar_after_token: int | None = None  # the grammar applies after this token (the end of a <think> block)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)  # looked up every token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_set = frozenset(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        self._check_finite()
        low, high = REPETITION_PENALTY_RANGE
        checks = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (low <= self.repetition_penalty <= high, "repetition_penalty",
             f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"),
            (len(self.logit_bias or ()) <= MAX_LOGIT_BIAS, "logit_bias",
             f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias or ())}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParamError(message, param)

    def _check_finite(self) -> None:
        """Range checks pass infinity where a side is open and NaN never; say why in one message."""
        floats = [("temperature", self.temperature), ("top_p", self.top_p), ("min_p", self.min_p),
                  ("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty),
                  ("repetition_penalty", self.repetition_penalty)]
        floats += [("logit_bias", bias) for bias in (self.logit_bias or {}).values()]
        for param, value in floats:
            if not math.isfinite(value):
                raise InvalidParamError(f"{param} must be a finite number, got {value}", param)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or one so small that only the argmax is its limit."""
        return self.temperature < GREEDY_TEMPERATURE
