"""Build the Cython extensions: pagegate.core and the CPU kernels (the rest is in pyproject.toml)."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        f"pagegate.core.{name}",
        [f"pagegate/core/{name.replace('.', '/')}.pyx"],
        include_dirs=[numpy.get_include()],
        extra_compile_args=["-O3"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for name in ("block_pool", "block_tables", "page_map", "seed.allocator")
] + [
    # the CPU kernels: fused paged attention and the quantized matmul; OpenMP threads, no numpy
    Extension(
        f"pagegate.kernels.{name}",
        [f"pagegate/kernels/{name}.pyx"],
        depends=[f"pagegate/kernels/{name}.h"],  # the C the module includes
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    for name in ("cpu_paged", "cpu_quant")
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
