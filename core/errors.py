"""Errors the SDK raises on purpose. `hearthlm` re-exports them; they live here so that
runtime and model_zoo can raise them without importing the sdk."""


class HearthError(Exception):
    """Base of every error hearthlm raises on purpose."""


class ModelLoadError(HearthError):
    """The model file is missing, malformed, or of an unsupported kind."""


class GGUFError(ModelLoadError):
    """The file is not a valid GGUF file (bad magic, cut short, absurd counts, ...)."""


class UnsupportedModelError(ModelLoadError):
    """The GGUF is valid but names an architecture, tensor type or tokenizer we cannot run."""


class ModelNotFoundError(ModelLoadError):
    """No model file could be found for the given path, Hub repo or model-zoo name."""


class ContextLengthError(HearthError):
    """A request does not fit in the context window."""


class InvalidRequestError(HearthError):
    """Bad arguments to generate/stream (empty prompt, bad sampling values, ...)."""


class RequestTimeoutError(HearthError, TimeoutError):
    """A request ran past its `timeout=`; it was aborted."""


class QueueFull(HearthError):
    """The engine's request queue is at its bound."""


class SessionClosedError(HearthError):
    """The session is closed (or its engine failed) and takes no more requests."""


class EngineFailedError(SessionClosedError):
    """The engine stopped after an internal error: every pending and later request fails
    with this, and `Session.health()` says why."""


class BackendError(HearthError):
    """A backend cannot run (unknown name, missing optional dependency, unsupported op)."""
