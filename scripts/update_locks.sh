#!/usr/bin/env bash
# Regenerate requirements/*.lock from pyproject.toml (`make lock`): exact versions with
# hashes for every venv the Makefile builds, so a fresh machine installs what was tested
# and a new upstream release changes nothing until the locks are regenerated on purpose.
# Needs uv (the Makefile's `lock` target installs the pinned one into .venv-lock).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
# The CI and developer machines: CPython 3.12 on x86-64 Linux with glibc >= 2.35.
common=(--python-version 3.12 --python-platform x86_64-manylinux_2_35 --generate-hashes
        --quiet --no-header --upgrade)
compile() {  # compile OUT ARGS...: one lock file
  local out=$1; shift
  "$UV" pip compile "${common[@]}" "$@" -o "requirements/$out"
  echo "wrote requirements/$out"
}
# .venv (make test, make train): the train, dev and parquet extras.
compile test.lock pyproject.toml requirements/build.in \
  --extra train --extra dev --extra parquet
# .venv plus triton for its CPU interpreter (make test-triton), held to test.lock's versions.
compile triton.lock pyproject.toml requirements/build.in \
  --extra train --extra dev --extra parquet --extra triton-interpret -c requirements/test.lock
# .venv-aot (make test-accelerators): libtpu and XLA's CUDA plugin, exact jax pins.
compile aot.lock pyproject.toml requirements/build.in \
  --extra train --extra dev --extra aot-tpu --extra aot-gpu
# .venv-gpu-extra (make test-gpu-extra): jax 0.11.x with jax-triton, and the CUDA plugin.
compile gpu-extra.lock pyproject.toml requirements/build.in requirements/gpu-extra.in \
  --extra gpu --extra train --extra dev
jax=$(sed -n 's/^jax==\([^ ]*\).*/\1/p' requirements/gpu-extra.lock)
plugin=$(sed -n 's/^jax-cuda12-plugin==\([^ ]*\).*/\1/p' requirements/gpu-extra.lock)
if [ "$jax" != "$plugin" ]; then
  echo "error: gpu-extra.lock has jax $jax but jax-cuda12-plugin $plugin:" \
       "set requirements/gpu-extra.in to $jax" >&2
  exit 1
fi
# The tokenizer fixture, without its dependencies.
compile tokenizer-fixture.lock requirements/tokenizer-fixture.in --no-deps
