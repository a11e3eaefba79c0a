"""All of pagegate's configuration in one place."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields, replace

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: int | float | str) -> int:
    """Parse a size like 2147483648, "2GiB", "512MB" or "1.5g" into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size in bytes (try '2GiB' or '512MB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


STEP_TOKENS, CPU_STEP_TOKENS = 2048, 512  # a step's token budget by default (SchedulerConfig.on_device)
# SchedulerConfig.key_slice_tokens on a CPU by default. bench/fair_keys.py (SmolLM2 Q4_1, 2 cores, 2 light users beside
# 64 heavy ones, one 30 s round each): the light key's TTFT over alone 6.64x off, 1.88x at 16, ~1.1-1.6x at 12, ~1.35x
# at 8; the heavy key's tok/s beside it 478 off, 465 at 16, 464 at 12, 357-381 at 8 (614 alone).
CPU_KEY_SLICE_TOKENS = 8
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "auto-4")  # --kv-cache-dtype


@dataclass
class CacheConfig:
    """The KV page pools."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit page count wins over the memory budgets below
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"
    gpu_memory_utilization: float = 0.9  # CUDA only, after a profiling forward
    swap_space: float = 0.0  # GiB of CPU memory for swapped-out pages
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of the pool kept free when admitting a new prompt
    # Batch-lane work (/v1/batches) is admitted only while this fraction of the pool more stays free, at most one
    # step's token budget of pages: room an arriving online prompt's first chunk takes without preempting anything.
    batch_headroom: float = 0.1
    max_pinned_fraction: float = 0.25  # of the pool, at most, held by prefix pins (released first under pressure)
    default_cpu_kv_cache_memory: str = "1GiB"  # CPU budget when nothing else is given
    kv_cache_dtype: str = "auto"  # the pages' format (pagegate.kernels.kv_format): auto, float32, ..., int8, fp8_e4m3
    kv_offload_memory: int | str | None = None  # host-memory tier under the prefix cache (bytes or "4GiB"); None: off
    kv_cache_dir: str | None = None  # disk tier under it, kept across restarts; None: off
    kv_cache_disk: int | str = "16GiB"  # the disk tier's budget
    kv_offload_min_reuse: int = 2  # a page goes down a tier once its hash was seen this often (1: always)


@dataclass
class SchedulerConfig:
    """Batch shape limits and preemption policy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # tokens a step holds; None: on_device chooses
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    preemption_mode: str | None = None  # "swap" | "recompute"; None: swap when swap_space > 0
    aging_rate: float = 1.0  # priority levels gained per second waited
    scheduling_policy: str = "fcfs"  # "priority": honour requests' priority (else a non-zero one is refused)
    preemption_window_s: float = 5.0  # auto-tuning window for the running cap
    swap_bounce_s: float = 2.0  # a swap-out this soon after a swap-in is a bounce
    # A step holds batch-lane tokens only when it holds no online ones, and at most this many: an online request
    # that arrives waits for one such step. bench/batches.py (SmolLM2 Q4_1, 2 cores): 8 kept online TTFT p99 within
    # 10% (16 added 10 ms to 44, 32 added 23) at 65% of the batch lane's uncapped speed on an idle server.
    batch_step_tokens: int = 8
    # While a key under half its weighted share of pages is at work, the keys over their share take at most this many
    # tokens a step together (engine/key_slices.py), so that the light key's prompts never wait for a long step; 0:
    # off; None: on_device chooses (CPU_KEY_SLICE_TOKENS on a CPU, off where a step of many decodes is short).
    key_slice_tokens: int | None = None

    def on_device(self, device_type: str, generates: bool) -> SchedulerConfig:
        """This config with the step's token budget and the key slices chosen where they were left to the device.

        NOTE: on a CPU a step of 2048 prompt tokens takes seconds (SmolLM2 on 2 cores: ~4 s), and every stream and
        every prompt that arrives waits for it: a prompt's next turn that the cache nearly completes waited ~1.5 s
        for ~0.4 s of work (bench/agent_cache.py). 512 (llama.cpp's micro-batch) keeps steps short at no cost in
        throughput measured there (prefill of 512 and 2,000 tokens, 64 parallel sequences: SmolLM2 Q4_1 and a
        100M F32 Llama within noise of 2048). An encoder's inputs run whole, so it keeps 2048."""
        cpu = device_type == "cpu"
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = CPU_STEP_TOKENS if cpu and generates else STEP_TOKENS
        slice_tokens = self.key_slice_tokens
        if slice_tokens is None:
            slice_tokens = CPU_KEY_SLICE_TOKENS if cpu else 0
        return replace(self, max_num_batched_tokens=budget, key_slice_tokens=slice_tokens)

    @property
    def step_tokens(self) -> int:
        """max_num_batched_tokens, once chosen (on_device)."""
        assert self.max_num_batched_tokens is not None, "on_device() chooses the step's token budget"
        return self.max_num_batched_tokens

    def table_shape(self, max_model_len: int, block_size: int) -> tuple[int, int]:
        """Block-table rows (running, swapped and forking sequences) and pages a row holds (one spare)."""
        return max(4 * self.max_num_seqs, 256), -(-max_model_len // block_size) + 1


@dataclass
class HealthThresholds:
    """The seed monitor's grades (section 3.3.5), configurable."""

    critical_swaps: int = 10
    critical_waiting: int = 50
    warning_usage: float = 0.95
    warning_waiting: int = 20
    good_usage: float = 0.80
    window_s: float = 60.0


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or SLURM/Kubernetes through it) started it, else None."""
    if all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


@dataclass
class LoRAConfig:
    """`--enable-lora`: adapters over the base model, their weights in pages of the KV budget (engine/lora/)."""

    max_loras: int = 4  # adapters resident at once (their pages held); more registered ones wait or are evicted
    max_lora_rank: int = 16  # an adapter of a larger rank is refused when it is registered
    modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (name, folder) registered at start, ids 1, 2, ...
    lora_dir: str | None = None  # --lora-dir: adapters loaded at run time must resolve inside it (None: anywhere)

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")


@dataclass
class EngineConfig:
    """Everything the engine needs to start."""

    model: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    quantization: str | None = None  # "gguf": keep GGUF blocks; "none": dequantize; None: gguf on CPU
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # a collective (all-reduce, step broadcast) that waits longer fails
    kv_events: KVEventsConfig | None = None  # --kv-events-config: publish prefix-cache changes for routers
    speculative: SpeculativeConfig | None = None  # --speculative-config: guess tokens, verify them in one forward
    task: str = "generate"  # --task: "generate" (a decoder; embeddings too with `pooling`) | "embed" (an encoder)
    pooling: str | None = None  # --pooling last | mean: /v1/embeddings from a generative model's hidden states
    lora: LoRAConfig | None = None  # --enable-lora: None serves the base model alone
    mmproj: str | None = None  # --mmproj: a GGUF model's image encoder, as llama.cpp's converter writes it
    image_cache_memory: int = 256 * 2**20  # --image-cache-memory: bytes of image-encoder output kept across requests
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    health: HealthThresholds = field(default_factory=HealthThresholds)


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`: the keys and defaults of vLLM's KVEventsConfig."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq", or "null" (events are taken from the pool and dropped)
    endpoint: str = "tcp://*:5557"  # a wildcard or ipc:// address is bound, any other is connected to
    replay_endpoint: str | None = None  # bound
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config key(s) {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config publisher {config.publisher!r}: use zmq or null")
        return config


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`: vLLM's JSON keys for n-gram (prompt lookup) or draft-model speculation."""

    method: str = "ngram"  # or "draft_model" (implied by `model`)
    model: str | None = None  # the draft: a smaller model of the same vocabulary
    num_speculative_tokens: int = 4  # at most this many guesses per sequence and step
    prompt_lookup_max: int = 4  # the longest suffix looked up in the sequence's earlier tokens
    prompt_lookup_min: int = 2  # the shortest
    max_batch_size: int = 8  # more running decodes than this: the step is compute-bound, speculation steps aside
    max_step_tokens: int = 16  # guesses fill a step up to this many tokens (the CPU decoder's step: bench/spec_decode)

    @classmethod
    def from_json(cls, text: str | dict) -> SpeculativeConfig:
        raw = json.loads(text) if isinstance(text, str) else dict(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown --speculative-config key(s) {unknown}; known: {sorted(known)}")
        if raw.get("model") is not None and "method" not in raw:
            raw["method"] = "draft_model"
        if "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
            raw["prompt_lookup_min"] = min(cls.prompt_lookup_min, raw["prompt_lookup_max"])
        config = cls(**raw)
        if config.method not in ("ngram", "draft_model"):
            raise ValueError(f"--speculative-config method {config.method!r}: use 'ngram' or 'draft_model'")
        if (config.method == "draft_model") != (config.model is not None):
            raise ValueError("--speculative-config: a draft model needs method 'draft_model' and a 'model' path")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ValueError("--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{config.prompt_lookup_min} and {config.prompt_lookup_max}")
        if not 1 <= config.num_speculative_tokens <= 16:
            raise ValueError(f"--speculative-config num_speculative_tokens must be within [1, 16], got "
                             f"{config.num_speculative_tokens}")
        return config
