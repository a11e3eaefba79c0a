"""Each KV page format's code in cpu_paged.h (PG_F32 ...), by its name (kv_format.FORMATS): what the C kernels are
told of a cache, importable without torch."""

FORMAT_NAMES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
FORMAT_CODES = {name: code for code, name in enumerate(FORMAT_NAMES)}
