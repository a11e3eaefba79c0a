"""The HTTP front end's settings (the engine's live in pagegate.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagegate.engine.tenants import KeyShare


@dataclass(frozen=True)
class ServedModel:
    """One model of a several-model server (--model repeated, --models-dir): the name clients use, its file."""

    name: str
    path: str | None  # a GGUF file or a checkpoint folder; None: the embedded model


@dataclass(frozen=True)
class ConfiguredKey:
    """An --api-key-config entry (pagegate.gateway.key_config): a client key and its share of the KV pages."""

    key: str
    share: KeyShare  # its name (what metrics show), weight and quota


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # pagegate.v1.Generation on host:grpc_port; 0: no gRPC server
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    # Keys that may also manage the server (models and adapters in and out, sleep, wake): pagegate.gateway.auth
    admin_api_keys: list[str] = field(default_factory=list)
    api_key_config: list[ConfiguredKey] = field(default_factory=list)  # --api-key-config: named, weighted keys
    prefix_cache_scope: str = "shared"  # "key": each API key its own prefix cache (needs api_keys)
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    max_queue: int | None = 1024  # waiting requests before 429; None: unbounded
    retry_after_s: int = 1  # the Retry-After a 429 carries
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers
    max_request_bytes: int = 16 * 1024 * 1024  # larger bodies get 413
    # Scoring work one request may ask for (prompt_logprobs, echo + logprobs): prompt tokens x (1 + alternatives),
    # summed over the prompts and the choices that carry them (pagegate/gateway/prepare.py); 400 beyond.
    max_scoring_tokens: int = 1_000_000
    max_images_per_prompt: int = 8  # --limit-mm-per-prompt '{"image": N}': image parts in one request; 400 beyond
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts http(s) image URLs may name; empty: none
    max_embedding_tokens: int = 300_000  # tokens of all the inputs of one /v1/embeddings request (OpenAI's); 400 beyond
    max_header_bytes: int = 64 * 1024  # request line + headers; larger heads get 431
    request_read_timeout_s: float = 30.0  # from a request's first byte to its last; 408 beyond (0: none)
    # A connection that sends nothing this long (before its first request or between two) is closed.
    idle_connection_timeout_s: float = 5.0
    # Open HTTP connections; one more takes the longest idle one's place (closed at once when none is idle).
    # Each is a file descriptor: keep `ulimit -n` above.
    max_connections: int = 512
    log_level: str = "info"
    data_parallel_size: int = 1  # engine cores, each its own process and page pool, behind this gateway
    # Several models behind one server (pagegate.gateway.model_slots): empty, the one model of the EngineConfig.
    models: list[ServedModel] = field(default_factory=list)
    models_max: int = 0  # models loaded at once (the least recently used idle one is unloaded); 0: all of them
    sleep_idle_s: float = 0.0  # a loaded model idle this long sleeps (its KV pages freed, weights kept); 0: never
    # Streamed chunks per second across all streams: with N streams each sends at most every N/rate s,
    # so under load a chunk carries several tokens and the event loop stays cheap; 0: every update.
    stream_chunk_rate: float = 500.0
    # On SIGTERM / Ctrl-C, seconds in-flight requests get to finish (new ones get 503) before the rest are ended;
    # 0, vLLM's default: end them at once.
    shutdown_timeout_s: float = 0.0
    # Then uvicorn's graceful shutdown: how long open responses get to send their last bytes before it cancels them.
    drain_timeout_s: float = 10.0
    # An engine core with work that sends nothing (no finished step) this long is taken for hung: /health 503, its
    # requests fail, new ones go to other cores (or get 503); 0: never.
    engine_step_timeout_s: float = 60.0
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for request spans; None: no tracing
    enable_dashboard: bool = True  # GET /dashboard and its feed under /dashboard/api/
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM gates them too)
    dashboard_max_viewers: int = 16  # open dashboard feeds; one more gets a 503 with Retry-After
    # Chat: the template (None: the model's own), how <think> blocks and tool calls are read from answers.
    chat_template: str | None = None  # the template's text (--chat-template FILE)
    reasoning_parser: str | None = None  # one of pagegate.gateway.answer.REASONING_PARSERS
    tool_call_parser: str = "auto"  # a format of pagegate.gateway.tool_formats, or auto: from the chat template
    # /v1/responses: stored responses (count, bytes of their conversations, age) and the pages they pin.
    responses_store_max_items: int = 1024
    responses_store_max_bytes: int = 64 * 1024 * 1024
    responses_store_ttl_s: float = 3600.0
    responses_store_path: str | None = None  # a SQLite file that keeps the store across restarts
    responses_max_input_items: int = 16384  # items in one request's input (OpenAI's bound)
    responses_pin_ttl_s: float = 600.0  # how long a stored response's pages stay pinned (within the pin budget)
    # The Files and Batch APIs (pagegate.gateway.batches): files, jobs and results under batch_dir, kept across
    # restarts; None: off (their routes answer 404 saying so).
    batch_dir: str | None = None
    batch_max_bytes: int = 10 * 1024**3  # the files' bytes under batch_dir; an upload past it is a 413
    batch_concurrency: int = 0  # batch lines in flight at once; 0: the engine's --max-num-seqs

    @property
    def client_api_keys(self) -> list[str]:
        """The ordinary keys: --api-key's and --api-key-config's."""
        return [*self.api_keys, *(entry.key for entry in self.api_key_config)]

    @property
    def every_api_key(self) -> list[str]:
        """The keys that open the API: the ordinary and the admin ones (an admin key works wherever another does)."""
        return [*self.client_api_keys, *self.admin_api_keys]
