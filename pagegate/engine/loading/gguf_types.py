"""GGUF's value types and ggml's tensor types with their block sizes: the tables of the `gguf` package
(gguf.constants) that reading a file takes, kept here so that reading one imports no `gguf` (its package imports
yaml and sentencepiece: ~30 ms of an engine core's start). tests/engine/loading/test_gguf_types.py holds them to
the package's.
"""

from __future__ import annotations

from enum import IntEnum

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
GGUF_DEFAULT_ALIGNMENT = 32


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLQuantizationType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_Q = GGMLQuantizationType
# each type's (values per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    _Q.F32: (1, 4), _Q.F16: (1, 2), _Q.Q4_0: (32, 18), _Q.Q4_1: (32, 20), _Q.Q5_0: (32, 22), _Q.Q5_1: (32, 24),
    _Q.Q8_0: (32, 34), _Q.Q8_1: (32, 40), _Q.Q2_K: (256, 84), _Q.Q3_K: (256, 110), _Q.Q4_K: (256, 144),
    _Q.Q5_K: (256, 176), _Q.Q6_K: (256, 210), _Q.Q8_K: (256, 292), _Q.IQ2_XXS: (256, 66), _Q.IQ2_XS: (256, 74),
    _Q.IQ3_XXS: (256, 98), _Q.IQ1_S: (256, 50), _Q.IQ4_NL: (32, 18), _Q.IQ3_S: (256, 110), _Q.IQ2_S: (256, 82),
    _Q.IQ4_XS: (256, 136), _Q.I8: (1, 1), _Q.I16: (1, 2), _Q.I32: (1, 4), _Q.I64: (1, 8), _Q.F64: (1, 8),
    _Q.IQ1_M: (256, 56), _Q.BF16: (1, 2), _Q.TQ1_0: (256, 54), _Q.TQ2_0: (256, 66), _Q.MXFP4: (32, 17),
    _Q.NVFP4: (64, 36), _Q.Q1_0: (128, 18),
}
