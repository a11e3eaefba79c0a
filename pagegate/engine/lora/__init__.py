"""LoRA adapters over the base model: read (PEFT folders), applied per row of a mixed batch, and paged beside the
KV cache (S-LoRA's unified paging)."""

from pagegate.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
