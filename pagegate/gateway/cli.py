"""`pagegate serve`: flags (named like `vllm serve`) -> EngineConfig + GatewayConfig -> uvicorn."""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType

import uvicorn

from pagegate.config import (
    CPU_KEY_SLICE_TOKENS,
    CPU_STEP_TOKENS,
    KV_CACHE_DTYPES,
    STEP_TOKENS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_bytes,
    torchrun_rank,
)
from pagegate.engine.sampling.params import SCHEDULING_POLICIES
from pagegate.gateway.access_log import redact_access_log
from pagegate.gateway.answer import REASONING_PARSERS
from pagegate.gateway.app import build_app, build_state
from pagegate.gateway.batches.disk import BatchDirInUse
from pagegate.gateway.engine_host import EngineHost
from pagegate.gateway.http_protocol import HeadLimitedH11Protocol, listen_backlog
from pagegate.gateway.key_config import load_key_config
from pagegate.gateway.model_slots import discover_models
from pagegate.gateway.request_id import RequestIdLogFilter, RequestIdMiddleware
from pagegate.gateway.settings import ConfiguredKey, GatewayConfig, ServedModel
from pagegate.gateway.shutdown import GracefulShutdown
from pagegate.gateway.tools import TOOL_CALL_PARSERS

API_KEY_ENV = "PAGEGATE_API_KEY"
ADMIN_API_KEY_ENV = "PAGEGATE_ADMIN_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagegate serve", description="Serve a model behind an OpenAI-compatible API.")
    _model_flags(parser.add_argument_group("model"))
    _cache_flags(parser.add_argument_group("KV cache"))
    _scheduler_flags(parser.add_argument_group("scheduler"))
    _server_flags(parser.add_argument_group("server"))
    _chat_flags(parser.add_argument_group("chat, tools and reasoning"))
    _lora_flags(parser.add_argument_group("LoRA adapters"))
    _batch_flags(parser.add_argument_group("Files and Batch APIs"))
    return parser


def _model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("model_tag", nargs="?", default=None, help="same as --model (positional, like vllm serve)")
    group.add_argument("--model", action="append", default=None,
                       help="a local Hugging Face checkpoint folder or GGUF file (default: the embedded model); "
                            "repeat it to serve several models behind one endpoint, each its own engine core, "
                            "picked by the requests' `model`")
    group.add_argument("--models-dir", default=None, metavar="DIR",
                       help="serve every *.gguf file and every folder with a config.json in DIR, named by its file "
                            "or folder name (llama.cpp's router flag); they load on their first request")
    group.add_argument("--models-max", type=_non_negative_int, default=0, metavar="N",
                       help="with several models, at most N loaded at once: the least recently used idle one is "
                            "unloaded to make room (llama.cpp's flag); 0: no bound")
    group.add_argument("--sleep-idle-seconds", type=_non_negative, default=0.0, metavar="S",
                       help="with several models, one with no request for S seconds sleeps: its KV pages are "
                            "freed for the others, its weights stay in memory (llama.cpp's flag); 0: never")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="the name(s) clients use in `model`; the first is reported (default: the model's name); "
                            "with several models, one name per model, in order")
    group.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--quantization", "-q", choices=["gguf", "none"], default=None,
                       help="gguf: keep a GGUF's F16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights in their blocks "
                            "(default on CPU); "
                            "none: dequantize every weight to --dtype")
    group.add_argument("--mmproj", default=None,
                       help="a GGUF model's image encoder and projector, as llama.cpp's convert_hf_to_gguf.py "
                            "--mmproj writes it (SmolVLM's); a Hugging Face folder brings its own")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split the model over N processes (torch.distributed: gloo on CPU, nccl on CUDA); "
                            "under torchrun, every rank runs `pagegate serve` and rank 0 serves")
    group.add_argument("--data-parallel-size", "-dp", type=_positive(int), default=1,
                       help="run N engine cores (processes), each with its own page pool and 1/N of the CPU cores; "
                            "a request goes to the core with the longest prefix hit, then the fewest pages in use")
    group.add_argument("--distributed-timeout", type=float, default=EngineConfig.distributed_timeout_s,
                       help="seconds a tensor-parallel collective may wait before the engine is declared dead")
    group.add_argument("--task", choices=["generate", "embed"], default=EngineConfig.task,
                       help="generate: a decoder (completions, chat, and embeddings from its hidden states: "
                            "--pooling); embed: a BERT sentence encoder folder (sentence-transformers pooling), "
                            "/v1/embeddings only")
    group.add_argument("--pooling", choices=["last", "mean", "none"], default=None,
                       help="how a generative model answers /v1/embeddings: the last prompt token's final hidden "
                            "state (the default), or the mean over the prompt, normalised; none: no embeddings "
                            "(a 400 that says how to enable them)")


def _cache_flags(group: argparse._ArgumentGroup) -> None:
    defaults = CacheConfig()
    group.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per KV page")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV pages (wins over budgets)")
    group.add_argument("--kv-cache-memory", default=None, help="KV budget in bytes or like '2GiB'")
    group.add_argument("--image-cache-memory", type=_size, default="256MiB",
                       help="image-encoder output a vision model's core keeps across requests (by image content "
                            "hash, least recently used out first)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype,
                       help="the KV pages' format, as vLLM's flag: auto is int8 on CPU and the model's dtype on "
                            "CUDA; int8 and fp8 keep one float16 scale per token and KV head inside the page")
    group.add_argument("--kv-events-config", type=_kv_events_config, default=None,
                       help="JSON, as vLLM's: publish prefix-cache changes over ZMQ for prefix-aware routers, e.g. "
                            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                            '"replay_endpoint": "tcp://*:5558", "topic": "kv@pod@model"}\'')
    group.add_argument("--speculative-config", type=_speculative_config, default=None,
                       help="JSON, as vLLM's: guess tokens from the sequence's own earlier ones and verify them in "
                            'one forward, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4}\'')
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    group.add_argument("--swap-space", type=float, default=defaults.swap_space, help="GiB of CPU memory for swapped pages")
    group.add_argument("--kv-offload-memory", type=_size, default=None,
                       help="a host-memory tier under the prefix cache, like '4GiB': evicted prefix pages go there "
                            "(on CPU: a second, larger pool outside the step's working set) and come back on a hit")
    group.add_argument("--kv-cache-dir", default=None,
                       help="a disk tier under it (one file per page): prefixes outlive the process (warm restarts)")
    group.add_argument("--kv-cache-disk", type=_size, default=defaults.kv_cache_disk, help="the disk tier's budget, like '16GiB'")
    group.add_argument("--kv-offload-min-reuse", type=_positive(int), default=defaults.kv_offload_min_reuse,
                       help="a page goes down a tier only once its prefix was seen this often (1: always)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_prefix_caching)
    group.add_argument("--max-pinned-fraction", type=float, default=defaults.max_pinned_fraction,
                       help="at most this fraction of the KV pages held for stored responses' next turns "
                            "(released first when requests need pages)")


def _scheduler_flags(group: argparse._ArgumentGroup) -> None:
    defaults = SchedulerConfig()
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help=f"tokens a step holds (default: {CPU_STEP_TOKENS} on a CPU, {STEP_TOKENS} on CUDA "
                            "and for an encoder)")
    group.add_argument("--preemption-mode", choices=["swap", "recompute"], default=None)
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=defaults.scheduling_policy,
                       help="priority: honour requests' priority (else a non-zero priority is a 400)")
    group.add_argument("--batch-step-tokens", type=_positive(int), default=defaults.batch_step_tokens, metavar="N",
                       help="batch-lane (/v1/batches) tokens a step at most; such a step holds no online tokens, and "
                            "an online request that arrives waits for it (default %(default)s)")
    group.add_argument("--key-slice-tokens", type=_non_negative_int, default=defaults.key_slice_tokens, metavar="N",
                       help="while an API key under half its share of pages is at work, the keys over their share "
                            "take at most N tokens a step together, so the light key never waits for a long step "
                            f"(0: off; default {CPU_KEY_SLICE_TOKENS} on a CPU, off on CUDA)")


def _server_flags(group: argparse._ArgumentGroup) -> None:
    defaults = GatewayConfig()
    group.add_argument("--host", default=defaults.host)
    group.add_argument("--port", type=int, default=defaults.port)
    group.add_argument("--grpc-port", type=int, default=defaults.grpc_port,
                       help="gRPC port on --host, same engine (0: no gRPC server)")
    group.add_argument("--api-key", action="append", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1 (repeatable; also ${API_KEY_ENV})")
    group.add_argument("--admin-api-key", action="append", default=None,
                       help="a key that may also load, unload, sleep and wake models and LoRA adapters (repeatable; "
                            f"also ${ADMIN_API_KEY_ENV}); with --api-key and none, nobody may")
    group.add_argument("--api-key-config", type=_key_config, default=None, metavar="FILE",
                       help="API keys with a name (what metrics show), a weight of the KV pages and an optional quota "
                            "of them: JSON or TOML entries {name, key, weight, max_kv_blocks}; they open the API "
                            "as --api-key ones do")
    group.add_argument("--prefix-cache-scope", choices=["shared", "key"], default=defaults.prefix_cache_scope,
                       help="key: salt every request's prefix cache with its API key, so no key hits (or learns "
                            "of) another's cached prefixes; needs --api-key")
    group.add_argument("--max-queue", type=int, default=defaults.max_queue,
                       help="waiting requests before new ones get 429 (-1: unbounded)")
    group.add_argument("--allowed-origins", nargs="+", default=None,
                       help="CORS origins (space or comma separated; '*' for any)")
    group.add_argument("--max-request-size", default=str(defaults.max_request_bytes),
                       help="largest request body in bytes or like '16MiB' (413 beyond)")
    group.add_argument("--max-scoring-tokens", type=_positive(int), default=defaults.max_scoring_tokens,
                       help="prompt scoring one request may ask for (prompt_logprobs, echo + logprobs): its prompt "
                            "tokens x (1 + the alternatives asked for), over its prompts and choices; 400 beyond")
    group.add_argument("--limit-mm-per-prompt", type=_image_limit, default=defaults.max_images_per_prompt,
                       help='images one request may hold, as vLLM writes it: \'{"image": 8}\'; 400 beyond')
    group.add_argument("--allowed-media-domains", nargs="+", default=[],
                       help="hosts whose http(s) image URLs the server fetches (a size and time cap apply); "
                            "without it only data: URLs are taken")
    group.add_argument("--max-embedding-tokens", type=_positive(int), default=defaults.max_embedding_tokens,
                       help="tokens of all the inputs of one /v1/embeddings request (OpenAI: 300,000); 400 beyond")
    group.add_argument("--request-timeout", type=float, default=defaults.request_read_timeout_s,
                       help="seconds to receive a whole request (head and body); 408 beyond, 0: no limit")
    group.add_argument("--idle-connection-timeout", type=_positive(float), default=defaults.idle_connection_timeout_s,
                       help="seconds a connection may send nothing (before its first request or between two) "
                            "before it is closed")
    group.add_argument("--max-connections", type=_positive(int), default=defaults.max_connections,
                       help="open HTTP connections; one more takes the place of the longest idle one, or is closed at "
                            "once when none is idle (each is a file: keep ulimit -n above)")
    group.add_argument("--max-header-size", default=str(defaults.max_header_bytes),
                       help="largest request line + headers in bytes or like '64KiB' (431 beyond)")
    group.add_argument("--stream-chunk-rate", type=float, default=defaults.stream_chunk_rate,
                       help="streamed chunks per second across all streams (each of N streams sends at most "
                            "every N/rate s, several tokens per chunk under load); 0: a chunk per update")
    group.add_argument("--shutdown-timeout", type=_non_negative, default=defaults.shutdown_timeout_s, metavar="S",
                       help="on SIGTERM or Ctrl-C, seconds in-flight requests get to finish while /health and new "
                            "requests get 503 (+ Retry-After); the rest then end with an error chunk. 0: end them at "
                            "once. A second signal ends the drain")
    group.add_argument("--engine-step-timeout", type=_non_negative, default=defaults.engine_step_timeout_s,
                       metavar="S", help="an engine core with work that finishes no step in S seconds is taken for "
                       "hung: /health turns 503, its requests fail (503 engine_stalled), new ones go to the other "
                       "cores (or get 503) until it steps again. 0: never")
    group.add_argument("--log-level", default=defaults.log_level,
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--disable-uvicorn-access-log", action="store_true")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export a span per request (queue, prefill, decode, preemptions) over OTLP/HTTP to this "
                            "collector, e.g. http://localhost:4318 (path /v1/traces unless given); needs "
                            "pip install 'pagegate[otel]'")
    group.add_argument("--disable-dashboard", action="store_true",
                       help="no live KV-page dashboard at /dashboard (and no feed under /dashboard/api/)")
    group.add_argument("--dashboard-max-viewers", type=_positive(int), default=defaults.dashboard_max_viewers,
                       help="open dashboard feeds; one more gets a 503 with Retry-After")


def _chat_flags(group: argparse._ArgumentGroup) -> None:
    defaults = GatewayConfig()
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a jinja chat template file used instead of the model's own")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split <think> blocks off answers: chat's reasoning_content, Responses' reasoning "
                            "items, Messages' thinking blocks (deepseek_r1: the answer starts inside the block)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=defaults.tool_call_parser,
                       help="the format the model writes tool calls in (auto: the one its chat template "
                            "writes, else hermes; the start-up log says which)")
    group.add_argument("--responses-store-max-items", type=_positive(int), default=defaults.responses_store_max_items,
                       help="stored /v1/responses kept at most (the oldest go first)")
    group.add_argument("--responses-store-max-bytes", default=str(defaults.responses_store_max_bytes),
                       help="bytes of stored conversations kept at most, like '64MiB'")
    group.add_argument("--responses-store-ttl", type=_positive(float), default=defaults.responses_store_ttl_s,
                       help="seconds a stored response is kept")
    group.add_argument("--responses-pin-ttl", type=_positive(float), default=defaults.responses_pin_ttl_s,
                       help="seconds a stored response's conversation keeps its KV pages pinned")
    group.add_argument("--responses-store-path", default=None, metavar="FILE",
                       help="a SQLite file that keeps stored responses across restarts (default: memory only)")
    group.add_argument("--responses-max-input-items", type=_positive(int),
                       default=defaults.responses_max_input_items,
                       help="items one /v1/responses request's input may hold (OpenAI's bound); more is a 400")


def _lora_flags(group: argparse._ArgumentGroup) -> None:
    defaults = LoRAConfig()
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters over the model (their weights in pages of the KV budget)")
    group.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                       help="adapters served by name from the start: name=path (a PEFT folder or a GGUF LoRA file) "
                            'or JSON \'{"name": ..., "path": ...}\'')
    group.add_argument("--max-loras", type=_positive(int), default=defaults.max_loras,
                       help="adapters resident at once; idle ones beyond are evicted LRU and paged in again on demand")
    group.add_argument("--max-lora-rank", type=_positive(int), default=defaults.max_lora_rank,
                       help="the largest adapter rank accepted")
    group.add_argument("--allow-runtime-lora", action="store_true",
                       help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    group.add_argument("--lora-dir", default=None, metavar="DIR",
                       help="a load_lora_adapter's lora_path must resolve (symlinks followed) inside DIR; default: "
                            "any path the server can read")


def _batch_flags(group: argparse._ArgumentGroup) -> None:
    defaults = GatewayConfig()
    group.add_argument("--batch-dir", default=None, metavar="DIR",
                       help="serve /v1/files and /v1/batches, keeping files, batches and their results in DIR: "
                            "a restarted server resumes every unfinished batch (default: off, the routes answer 404)")
    group.add_argument("--batch-max-bytes", type=_size, default=f"{defaults.batch_max_bytes / 1024**3:g}GiB",
                       help="the most bytes the files under --batch-dir may hold, like '10GiB'; an upload past it "
                            "is a 413 (batch outputs count too)")
    group.add_argument("--batch-concurrency", type=_positive(int), default=None, metavar="N",
                       help="batch lines in flight at once, all batches together (default: --max-num-seqs); they "
                            "run below every online request")


def _lora_module(text: str) -> tuple[str, str]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
            return str(item["name"]), str(item["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise argparse.ArgumentTypeError(f'not {{"name": ..., "path": ...}}: {error}') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"not name=path: {text!r}")
    return name, path


def _lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    if not args.enable_lora:
        if args.lora_modules or args.allow_runtime_lora or args.lora_dir:
            raise SystemExit("--lora-modules, --allow-runtime-lora and --lora-dir need --enable-lora")
        return None
    if args.model and len(args.model) > 1 or args.models_dir:
        raise SystemExit("--enable-lora serves adapters over one model: it does not combine with several models yet")
    return LoRAConfig(args.max_loras, args.max_lora_rank, tuple(args.lora_modules), args.lora_dir)


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _image_limit(text: str) -> int:
    """--limit-mm-per-prompt: vLLM's JSON of counts per modality; images are the one this server takes."""
    try:
        limits = json.loads(text)
    except ValueError:
        limits = None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 1), int) \
            or limits.get("image", 1) < 1:
        raise argparse.ArgumentTypeError(f'give a JSON object like \'{{"image": 4}}\' (images only, >= 1), not {text}')
    return int(limits.get("image", 8))


def _size(text: str) -> str:
    """A size like '4GiB' (kept as given; checked here so a typo is a usage error, not a failed engine start)."""
    try:
        parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _key_config(path: str) -> list[ConfiguredKey]:
    try:
        return load_key_config(path)
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(str(error)) from None


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, GatewayConfig]:
    names = args.served_model_name or []
    cache = CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                        swap_space=args.swap_space, enable_prefix_caching=args.enable_prefix_caching,
                        max_pinned_fraction=args.max_pinned_fraction, kv_cache_dtype=args.kv_cache_dtype,
                        kv_offload_memory=args.kv_offload_memory, kv_cache_dir=args.kv_cache_dir,
                        kv_cache_disk=args.kv_cache_disk, kv_offload_min_reuse=args.kv_offload_min_reuse)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
                                scheduling_policy=args.scheduling_policy, batch_step_tokens=args.batch_step_tokens,
                                key_slice_tokens=args.key_slice_tokens)
    paths = list(args.model or ([args.model_tag] if args.model_tag else []))
    models = served_models(paths, names, args.models_dir)
    if models:  # several models: a name each (--served-model-name gave one per model, not aliases)
        names = []
    engine = EngineConfig(model=paths[0] if paths else None, served_model_name=names[0] if names else None,
                          dtype=args.dtype, device=args.device, seed=args.seed, quantization=args.quantization,
                          tensor_parallel_size=args.tensor_parallel_size,
                          distributed_timeout_s=args.distributed_timeout, kv_events=args.kv_events_config,
                          speculative=args.speculative_config, cache=cache, scheduler=scheduler, task=args.task,
                          pooling=_pooling(args.task, args.pooling), lora=_lora_config(args),
                          image_cache_memory=parse_bytes(args.image_cache_memory), mmproj=args.mmproj)
    keys = list(args.api_key or [])
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    admin_keys = list(args.admin_api_key or [])
    if os.environ.get(ADMIN_API_KEY_ENV):
        admin_keys.append(os.environ[ADMIN_API_KEY_ENV])
    origins = [o.strip() for item in args.allowed_origins or [] for o in item.split(",") if o.strip()]
    if args.data_parallel_size > 1 and args.tensor_parallel_size > 1:
        raise SystemExit("--data-parallel-size with --tensor-parallel-size is not supported: pick one")
    configured = args.api_key_config or []
    if args.prefix_cache_scope == "key" and not (keys or admin_keys or configured):
        raise SystemExit("--prefix-cache-scope key needs --api-key (or $PAGEGATE_API_KEY): without keys there is "
                         "one tenant")
    gateway = GatewayConfig(host=args.host, port=args.port, grpc_port=args.grpc_port, api_keys=keys,
                            admin_api_keys=admin_keys, api_key_config=configured,
                            served_model_names=list(names), prefix_cache_scope=args.prefix_cache_scope,
                            max_queue=None if args.max_queue is not None and args.max_queue < 0 else args.max_queue,
                            allowed_origins=origins, max_request_bytes=parse_bytes(args.max_request_size),
                            max_scoring_tokens=args.max_scoring_tokens,
                            max_embedding_tokens=args.max_embedding_tokens,
                            max_images_per_prompt=args.limit_mm_per_prompt,
                            allowed_media_domains=[d for item in args.allowed_media_domains for d in item.split(",")
                                                   if d],
                            max_header_bytes=parse_bytes(args.max_header_size),
                            request_read_timeout_s=args.request_timeout,
                            idle_connection_timeout_s=args.idle_connection_timeout,
                            max_connections=args.max_connections, data_parallel_size=args.data_parallel_size,
                            models=models, models_max=args.models_max, sleep_idle_s=args.sleep_idle_seconds,
                            stream_chunk_rate=args.stream_chunk_rate, shutdown_timeout_s=args.shutdown_timeout,
                            engine_step_timeout_s=args.engine_step_timeout,
                            log_level=args.log_level, otlp_traces_endpoint=args.otlp_traces_endpoint,
                            enable_dashboard=not args.disable_dashboard,
                            dashboard_max_viewers=args.dashboard_max_viewers,
                            allow_runtime_lora=args.allow_runtime_lora,
                            chat_template=_read_template(args.chat_template), reasoning_parser=args.reasoning_parser,
                            tool_call_parser=args.tool_call_parser,
                            responses_store_max_items=args.responses_store_max_items,
                            responses_store_max_bytes=parse_bytes(args.responses_store_max_bytes),
                            responses_store_ttl_s=args.responses_store_ttl,
                            responses_store_path=args.responses_store_path,
                            responses_max_input_items=args.responses_max_input_items,
                            responses_pin_ttl_s=args.responses_pin_ttl,
                            batch_dir=args.batch_dir, batch_max_bytes=parse_bytes(args.batch_max_bytes),
                            batch_concurrency=args.batch_concurrency or 0)
    return engine, gateway


def served_models(paths: list[str], names: list[str], models_dir: str | None) -> list[ServedModel]:
    """The models of a several-model server (--model repeated, then --models-dir's), each named by its
    --served-model-name (in order), else by its file or folder name; empty for a one-model server."""
    if len(paths) <= 1 and models_dir is None:
        return []
    models = [ServedModel(_model_name(path), path) for path in paths]
    models += discover_models(models_dir) if models_dir is not None else []
    if len(names) > len(models):
        raise SystemExit(f"--served-model-name: {len(names)} names for {len(models)} models (one name per model)")
    models = [replace(model, name=name) for model, name in zip(models, names, strict=False)] + models[len(names):]
    seen = [model.name for model in models]
    if len(set(seen)) != len(seen):
        raise SystemExit(f"two models have the same name ({', '.join(seen)}): name them with --served-model-name")
    return models


def _model_name(path: str) -> str:
    """A GGUF file's name without its extension; a folder's name."""
    return Path(path).stem if path.lower().endswith(".gguf") else Path(path.rstrip("/")).name


def _pooling(task: str, pooling: str | None) -> str | None:
    """--pooling as the engine takes it. NOTE: a generative server answers embeddings by default (as Ollama does),
    from the last prompt token's final hidden state: the OpenAI SDK's embeddings.create (and LangChain's, and
    LlamaIndex's) then work against a plain `pagegate serve` instead of failing. It costs generations nothing (an
    embedding is a prefill-only request under the same scheduler, its share of a step bounded) and the vectors
    are documented as what they are: a decoder's hidden states, not a trained embedding model's (for retrieval,
    serve one with --task embed). Last-token, not mean: in a causal decoder only the last position has seen the
    whole prompt (vLLM's default for decoders used as embedders). An encoder (--task embed) pools its own way."""
    if task == "embed" or pooling == "none":
        return None if pooling in (None, "none") else pooling  # the encoder refuses an explicit --pooling
    return pooling or "last"


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as error:
        raise SystemExit(f"--chat-template: cannot read {path}: {error.strerror}") from None


class GatewayServer(uvicorn.Server):
    """uvicorn, plus: a signal first drains (--shutdown-timeout) or ends every in-flight generation, and only
    then starts uvicorn's shutdown; a clean stop exits 0."""

    def __init__(self, config: uvicorn.Config, host: EngineHost, shutdown_timeout_s: float = 0.0) -> None:
        super().__init__(config)
        self.host = host
        self.exit_code = 0
        self.graceful = GracefulShutdown(host, shutdown_timeout_s, self._stop_serving)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after the graceful stop.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        loop = self.host.loop
        if self.should_exit or loop is None or loop.is_closed():
            self.should_exit = True
            return
        # A fresh context: the signal interrupted some request's task, whose request id the drain must not log.
        loop.call_soon_threadsafe(self.graceful.on_signal, context=contextvars.Context())

    def _stop_serving(self) -> None:
        self.should_exit = True  # uvicorn's main loop sees it within 0.1 s and begins its shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.graceful.cancel()
        await super().shutdown(sockets)

    def fail(self) -> None:
        """The engine could not start or died: stop with a non-zero exit code."""
        self.exit_code = 1
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine_config, config = configs_from_args(args)
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdLogFilter())
    rank = torchrun_rank()
    if rank:  # torchrun started this process as a tensor-parallel worker: rank 0 serves
        from pagegate.engine.tp_workers import worker_main

        worker_main(rank, "env://", engine_config)
        return 0
    holder: list[GatewayServer] = []
    try:
        state = build_state(engine_config, config, on_fatal=lambda: holder[0].fail())
        app = build_app(state)
    # --otlp-traces-endpoint without the OpenTelemetry SDK installed; a --batch-dir another server holds
    except (ImportError, BatchDirInUse) as error:
        raise SystemExit(str(error)) from None
    # h11 pinned: "auto" takes httptools when installed, which bounds no request head (HeadLimitedH11Protocol
    # answers 431 past --max-header-size). No WebSocket route exists: ws "auto" would import the websockets
    # package where it is installed (~12 ms of start-up) for nothing.
    uv_config = uvicorn.Config(RequestIdMiddleware(app), host=config.host, port=config.port, log_level=args.log_level,
                               access_log=not args.disable_uvicorn_access_log,
                               http=HeadLimitedH11Protocol.with_limits(config.request_read_timeout_s,
                                                                       config.max_connections),
                               timeout_keep_alive=config.idle_connection_timeout_s,  # type: ignore[arg-type]
                               backlog=listen_backlog(config.max_connections),
                               h11_max_incomplete_event_size=config.max_header_bytes,
                               timeout_graceful_shutdown=int(config.drain_timeout_s), lifespan="on", ws="none")
    redact_access_log()  # after uvicorn.Config, which sets up uvicorn's loggers
    server = GatewayServer(uv_config, state["host"], config.shutdown_timeout_s)
    holder.append(server)
    server.run()
    if not server.started and server.exit_code == 0:
        return 1  # could not bind, or the lifespan failed
    return server.exit_code
