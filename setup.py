"""Build the Cython extensions: pagegate.core, the CPU kernels and the GGUF string reader (the rest is in
pyproject.toml)."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        f"pagegate.core.{name}",
        [f"pagegate/core/{name.replace('.', '/')}.pyx"],
        include_dirs=[numpy.get_include()],
        depends=["pagegate/core/page_hash.h"],
        extra_compile_args=["-O3"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for name in ("block_pool", "block_tables", "page_map", "seed.allocator")
] + [
    # a GGUF's string arrays (its tokenizer's vocabulary and merges), read in C
    Extension("pagegate.engine.loading.gguf_strings", ["pagegate/engine/loading/gguf_strings.pyx"],
              extra_compile_args=["-O3"]),
] + [
    # the CPU kernels: fused paged attention, the quantized matmul and the native decode step; OpenMP
    # threads, no numpy.
    # The block decodes get no fused multiply-add the source does not ask for: they round as gguf's do.
    Extension(
        f"pagegate.kernels.{name}",
        [f"pagegate/kernels/{name}.pyx"],
        # the C the module includes, and the declarations of it that cpu_quant and cpu_decode share
        depends=[f"pagegate/kernels/{header}.h" for header in headers] + ["pagegate/kernels/cpu_qdot.pxd"],
        extra_compile_args=["-O3", "-fopenmp", *flags],
        extra_link_args=["-fopenmp"],
    )
    for name, headers, flags in (
        ("cpu_paged", ("cpu_paged", "cpu_page_rows", "cpu_tiles_avx2", "cpu_tiles_isa"), ()),
        ("cpu_quant", ("cpu_quant", "cpu_qx8", "cpu_panels", "cpu_qdot", "cpu_qdot_isa", "cpu_qx8_isa"),
         ("-ffp-contract=off",)),
        ("cpu_decode", ("cpu_decode", "cpu_paged", "cpu_page_rows", "cpu_tiles_avx2", "cpu_tiles_isa", "cpu_quant",
                        "cpu_qdot", "cpu_qx8", "cpu_panels", "cpu_qdot_isa", "cpu_qx8_isa", "cpu_lora"),
         ("-ffp-contract=off",)),
        ("cpu_sample", ("cpu_sample", "cpu_paged", "cpu_page_rows", "cpu_tiles_avx2", "cpu_tiles_isa"), ()))
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
