"""What names an adapter in a request: vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (what a request's `model` says), a positive integer id (KV events carry it) and the
    folder it is read from (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id}")
