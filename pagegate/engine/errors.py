"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """One request could not be completed (e.g. it alone needs more KV pages than exist)."""
