"""Each KV page format's code in cpu_paged.h (PG_F32 ...), by its name (kv_format.FORMATS): what the C kernels are
told of a cache, importable without torch."""

FORMAT_NAMES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
FORMAT_CODES = {name: code for code, name in enumerate(FORMAT_NAMES)}


def row_bytes(name: str, head_dim: int) -> int:
    """The bytes of one stored (token, KV head) row of K or V in the format `name` (kv_format.KVFormat.row_bytes):
    float values as they are; one-byte values then a float16 scale; int4 two values a byte, then its scale."""
    if name == "int4":
        return head_dim // 2 + 2
    return {"float32": 4 * head_dim, "float16": 2 * head_dim, "bfloat16": 2 * head_dim}.get(name, head_dim + 2)
