"""KV page formats: how one (token, KV head) row of K or V is stored in a page.

Float formats store the head_dim values as they are (float32, float16, bfloat16). The one-byte formats (int8,
fp8 e4m3, fp8 e5m2) store head_dim values and then the row's largest magnitude (amax) as a float16 in the row's
last two bytes; a value reads back as stored * scale with scale = amax * (1 / max_value) in float32. int4 packs
two values a byte (value i in the low nibble of byte i, value i + head_dim / 2 in its high one, each stored as
q + 8 for q in [-8, 7]), then, where the others keep amax, minus the row's value of largest magnitude (m, the
positive one of a tie): scale = -m / 8, so m itself is stored exactly as -8 and all 16 levels serve (llama.cpp's
q4_0 rounding; on SmolLM2 its perplexity rise is half that of +-amax / 7). Its rows hold rotated vectors
(rotation.py), which the attention, not the format, rotates and rotates back. A cache
tensor is [num_blocks, block_size, num_kv_heads, head_dim (+ 2)] of the format's own dtype and a page is
self-contained bytes: copy-on-write, swap, prefix hits, TP slices and rollback move it without knowing its format.

NOTE: the row keeps its amax, not amax / max_value: the quotient falls into float16's subnormals (and loses its
precision) for rows with amax below 3.5 under e5m2's max_value of 57344, amax itself only below 6e-5.
One scale per token and KV head (llama.cpp's q8_0 keeps one per 32 values). At head_dim 64 that costs 2 bytes
in 66 (a row 3.88x smaller than float32's) against 4 in 68 for q8_0-style blocks, each row is quantized once when it is
written (no page ever changes scale later), and a dot product needs one multiply by the scale per key, not two.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from pagegate.kernels.rotation import rotatable

SCALE_BYTES = 2  # a float16 per scaled row
FLOAT16_MAX = 65504.0  # the largest amax a row keeps; larger values saturate


@dataclass(frozen=True)
class KVFormat:
    """One page format: `dtype` is the cache tensor's, `max_value` the largest magnitude a scaled value holds."""

    name: str
    dtype: torch.dtype
    max_value: float = 0.0  # 0: a float format, stored unscaled
    bits: int = 0  # 4: two values a byte (int4), rows rotated

    @property
    def rotated(self) -> bool:
        """Rows hold R k and R v (rotation.py): queries are rotated to meet them, outputs rotated back."""
        return self.bits == 4

    @property
    def scaled(self) -> bool:
        return self.max_value > 0

    @property
    def inverse_max(self) -> torch.Tensor:
        """1 / max_value rounded to float32, as the kernels hold it."""
        return torch.tensor(1.0 / self.max_value, dtype=torch.float32)

    def row_width(self, head_dim: int) -> int:
        """Elements of one stored row: head_dim values (int4: half as many bytes), and the scale's two bytes."""
        if self.rotated:
            return head_dim // 2 + SCALE_BYTES
        return head_dim + SCALE_BYTES if self.scaled else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.dtype.itemsize

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token in every layer."""
        return 2 * num_layers * num_kv_heads * self.row_bytes(head_dim)

    def describe(self, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
        """What the start-up line says of the pages, e.g. "int8 pages, 3,960 bytes a token"."""
        return f"{self.name} pages, {self.bytes_per_token(num_layers, num_kv_heads, head_dim):,} bytes a token"

    def empty(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
        """A zeroed cache tensor [num_blocks, block_size, num_kv_heads, row_width] (zero bytes: zero values, int4's
        too: their scale is zero). ValueError for int4 pages of a head size the rotation cannot take."""
        if self.rotated and not rotatable(head_dim):
            raise ValueError(f"int4 pages rotate each head, which needs a power-of-two head size up to 256, not "
                             f"{head_dim}: choose int8 pages for this model")
        shape = (num_blocks, block_size, num_kv_heads, self.row_bytes(head_dim))
        return torch.zeros(shape, dtype=torch.uint8, device=device, pin_memory=pin_memory).view(self.dtype)


FORMATS = {f.name: f for f in (
    KVFormat("float32", torch.float32), KVFormat("float16", torch.float16), KVFormat("bfloat16", torch.bfloat16),
    KVFormat("int8", torch.int8, 127.0), KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0), KVFormat("int4", torch.uint8, 8.0, bits=4))}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}
AUTO_4 = "auto-4"  # int8 pages in the quarter of layers where int4 costs most, int4 in the rest (kv_calibration.py)


@dataclass(frozen=True)
class LayerFormats:
    """The pages' format in each layer: `name` is what --kv-cache-dtype asked for (auto-4 mixes int8 and int4)."""

    name: str
    formats: tuple[KVFormat, ...]

    @classmethod
    def uniform(cls, fmt: KVFormat, num_layers: int) -> LayerFormats:
        return cls(fmt.name, (fmt,) * num_layers)

    @property
    def key(self) -> str:
        """The name with each layer's format where they differ: what the bytes of a page depend on."""
        if all(f.name == self.name for f in self.formats):
            return self.name
        return f"{self.name}:{','.join(f.name for f in self.formats)}"

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token in every layer."""
        return sum(f.bytes_per_token(1, num_kv_heads, head_dim) for f in self.formats)

    def describe(self, num_kv_heads: int, head_dim: int) -> str:
        """What the start-up line says of the pages, e.g. "int8 pages, 3,960 bytes a token"."""
        counts = Counter(f.name for f in self.formats)
        mix = "" if self.key == self.name else " (" + ", ".join(
            f"{n} layer{'s' * (n > 1)} {name}" for name, n in sorted(counts.items())) + ")"
        return f"{self.name} pages{mix}, {self.bytes_per_token(num_kv_heads, head_dim):,} bytes a token"


def resolve_format(name: str, model_dtype: torch.dtype, device: torch.device) -> KVFormat:
    """The format `--kv-cache-dtype name` gives pages of a model computing in model_dtype on device ("auto": int8 on
    a CPU, the model's dtype elsewhere; auto-4: int4, the format of a draft model's pages beside a target's auto-4
    mix); a format the device cannot serve is refused here, at start, never replaced by another.

    NOTE: int8 is the CPU's default for what was measured there: a quarter of float32's bytes a token (SmolLM2: 11.9
    KB against 46.1), +0.12% perplexity (bench/kv_quality.py), and the fastest decode at long context (kv_speed)."""
    if name == AUTO_4:  # a model's own pages take int8 in some layers (kv_calibration.py); one format here: int4's
        name = "int4"
    if name != "auto" and name not in FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of auto, {AUTO_4}, {', '.join(FORMATS)}")
    if name == "auto":
        return FORMATS["int8"] if device.type == "cpu" else _BY_DTYPE.get(model_dtype, FORMATS["float32"])
    fmt = FORMATS[name]
    if device.type == "cuda" and fmt.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{name} pages need compute capability 8.9+ (Triton's fp8 e4m3 conversions); {device} has "
                         f"{torch.cuda.get_device_capability(device)}: int8 or fp8_e5m2 pages need no such support")
    return fmt


def format_of(cache: torch.Tensor) -> KVFormat:
    """The format a cache tensor holds (its dtype says it)."""
    try:
        return _BY_DTYPE[cache.dtype]
    except KeyError:
        raise ValueError(f"a KV cache of dtype {cache.dtype} is no page format") from None


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size of a cache tensor's rows (its last dimension, less a scaled format's scale bytes)."""
    fmt = format_of(cache)
    if fmt.rotated:
        return (cache.shape[-1] - SCALE_BYTES) * 2
    return cache.shape[-1] - (SCALE_BYTES if fmt.scaled else 0)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache's one-byte formats as uint8 (fp8 tensors lack index ops on CPU); float formats as they are."""
    return cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache


def quantize_rows(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """rows [..., D] as stored rows [..., row_width] of `fmt`: a scaled row is x * (1 / s) rounded (int8) or
    converted (fp8), clamped to max_value, with s = float16(amax) * (1 / max_value); then amax's two bytes."""
    if not fmt.scaled:
        return rows.to(fmt.dtype)
    if fmt.rotated:
        return _quantize_int4(rows.float(), fmt)
    x = rows.float()
    amax = x.abs().amax(-1, keepdim=True).clamp(max=FLOAT16_MAX).to(torch.float16)  # beyond: values saturate
    s = amax.float() * fmt.inverse_max
    values = x * torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    values = values.clamp(-fmt.max_value, fmt.max_value)
    stored = values.round().to(torch.int8) if fmt.dtype == torch.int8 else values.to(fmt.dtype)
    return torch.cat([stored.view(torch.uint8), amax.view(torch.uint8)], -1).view(fmt.dtype)


def _quantize_int4(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """int4 rows (the module's docstring): q = x * (1 / s) rounded, in [-8, 7], s = float16(-m) * (1 / 8)."""
    top, bottom = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    m = torch.where(top >= -bottom, top, bottom)  # the value of largest magnitude, the positive one of a tie
    stored = (-m).clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)  # beyond: values saturate
    s = stored.float() * fmt.inverse_max
    values = x * torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    nibbles = (values.clamp(-8.0, 7.0).round() + 8).to(torch.uint8)
    half = nibbles.shape[-1] // 2
    return torch.cat([nibbles[..., :half] | (nibbles[..., half:] << 4), stored.view(torch.uint8)], -1)


def dequantize_rows(stored: torch.Tensor, head_dim: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows [..., row_width] of any format back as values [..., head_dim]."""
    fmt = format_of(stored)
    if not fmt.scaled:
        return stored.to(out_dtype)
    raw = stored.view(torch.uint8)
    width = head_dim // 2 if fmt.rotated else head_dim
    if fmt.rotated:
        packed = raw[..., :width].to(torch.int16)
        values = torch.cat([(packed & 15) - 8, (packed >> 4) - 8], -1).float()
    else:
        values = raw[..., :width].view(fmt.dtype).float()
    scale = raw[..., width:].contiguous().view(torch.float16).float() * fmt.inverse_max
    return (values * scale).to(out_dtype)
