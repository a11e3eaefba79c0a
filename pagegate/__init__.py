"""pagegate: an OpenAI-compatible LLM server built around paged KV-cache management.

Heavy names (LLM, SamplingParams, ...) import lazily, so `pagegate.clients` stays free of torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagegate.engine.llm",
    "SamplingParams": "pagegate.engine.sampling.params",
    "RequestOutput": "pagegate.engine.outputs",
    "CompletionOutput": "pagegate.engine.outputs",
    "AsyncEngine": "pagegate.engine.serving.async_engine",
    "EngineConfig": "pagegate.config",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagegate' has no attribute {name!r}")


__all__ = list(_LAZY) + ["__version__"]
