"""pytest-benchmark of the core against the seed's allocator (`make bench`); see bench/core.py for ratios."""

import pytest

from pagegate.core.seed.allocator import BlockAllocator
from pagegate.testing.seed_allocator import BlockAllocator as SeedAllocator

from . import core_workloads as w

IMPLS = ["pagegate", "seed"]
ALLOCATORS = {"pagegate": BlockAllocator, "seed": SeedAllocator}  # both behind the seed's API


@pytest.mark.benchmark(group="W1 allocate(1)+free x100k")
@pytest.mark.parametrize("impl", IMPLS)
def test_w1(benchmark, impl):
    benchmark.pedantic(getattr(w, f"w1_{impl}"), rounds=5)


@pytest.mark.benchmark(group="W2 allocate(64)+free x10k")
@pytest.mark.parametrize("impl", IMPLS)
def test_w2(benchmark, impl):
    benchmark.pedantic(getattr(w, f"w2_{impl}"), rounds=5)


@pytest.mark.benchmark(group="W3 serving trace, 2000 steps")
@pytest.mark.parametrize("impl", IMPLS)
def test_w3(benchmark, impl):
    trace = w.ServingTrace()
    benchmark.pedantic(getattr(w, f"w3_{impl}"), args=(trace,), rounds=3)


@pytest.mark.benchmark(group="W4 share 64 pages into 16 x200")
@pytest.mark.parametrize("impl", IMPLS)
def test_w4(benchmark, impl):
    benchmark.pedantic(getattr(w, f"w4_{impl}"), rounds=5)


@pytest.mark.benchmark(group="W2 seed API: allocate(seq, 64)+free(seq) x10k")
@pytest.mark.parametrize("impl", IMPLS)
def test_w2_seed_api(benchmark, impl):
    benchmark.pedantic(w.w2_seed, kwargs={"allocator": ALLOCATORS[impl]}, rounds=5)


@pytest.mark.benchmark(group="W3 seed API: serving trace, 2000 steps")
@pytest.mark.parametrize("impl", IMPLS)
def test_w3_seed_api(benchmark, impl):
    trace = w.SeedApiTrace(w.ServingTrace())
    benchmark.pedantic(w.w3_seed_api, args=(trace, ALLOCATORS[impl]), rounds=5)


@pytest.mark.benchmark(group="batch builder 256 seqs x 128 pages")
def test_builder(benchmark):
    setup = w.builder_setup()
    benchmark(setup[0].build, setup[1], setup[2])
