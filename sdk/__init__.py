"""hearthlm: embeddable async LLM inference.

    async with Session.open("smollm2-135m-instruct") as s:
        print((await s.generate("The capital of France is", max_tokens=16)).text)
"""
from hearthlm.core.errors import (
                                     BackendError,
                                     ContextLengthError,
                                     EngineFailedError,
                                     GGUFError,
                                     HearthError,
                                     InvalidRequestError,
                                     ModelLoadError,
                                     ModelNotFoundError,
                                     QueueFull,
                                     RequestTimeoutError,
                                     SessionClosedError,
                                     UnsupportedModelError,
)
from hearthlm.model_zoo.template_limits import TemplateLimits
from hearthlm.options import SessionOptions
from hearthlm.runtime.sampling import SamplingParams
from hearthlm.session import Session
from hearthlm.sync import SyncSession
from hearthlm.types import Chunk, Completion

__all__ = [
    "Session", "SessionOptions", "SyncSession", "SamplingParams", "TemplateLimits", "Completion", "Chunk",
    "HearthError", "ModelLoadError", "GGUFError", "UnsupportedModelError", "ModelNotFoundError",
    "ContextLengthError", "InvalidRequestError", "QueueFull", "RequestTimeoutError", "SessionClosedError",
    "EngineFailedError", "BackendError",
]
