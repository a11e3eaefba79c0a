"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class EngineStalledError(RuntimeError):
    """An engine core with work has finished no step within the step timeout (it hangs); try again later."""


class RequestFailedError(RuntimeError):
    """One request could not be completed (e.g. it alone needs more KV pages than exist)."""


class InvalidParamError(ValueError):
    """A request parameter is out of range; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelLoadError(ValueError):
    """A model folder cannot be served: unsupported architecture, bad config or bad weights."""
