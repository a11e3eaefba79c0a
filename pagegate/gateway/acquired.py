"""What `EngineHost.acquire` hands a request: the slot of the model it names, that model's running engine and its
context, found once. Admission and the engine requests take it as it is and never look the model up by name again."""

from __future__ import annotations

from dataclasses import dataclass

from pagegate.engine.serving.engine_client import EngineClient
from pagegate.gateway.model_slots import ModelSlot
from pagegate.gateway.prepare import ModelContext


@dataclass(frozen=True)
class AcquiredModel:
    """A request's model: its slot (state, in-flight count, embedding size), the engine that was running when the
    request acquired it, and the context its body is prepared against (names, tokenizer, limits, adapters)."""

    slot: ModelSlot
    engine: EngineClient
    model: ModelContext
