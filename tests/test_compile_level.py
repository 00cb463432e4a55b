"""The default test run compiles at XLA's backend optimization level 0 (tests/conftest.py).

That choice is only sound if it cannot change a result. This compares, bit for bit, the
quantized GEMMs (forward values and both gradients) and the quantizers, on adversarial
inputs (ties, zeros, subnormals, saturation, NaN, Inf, K not a multiple of 32), compiled in
this process (at level 0) and in a fresh process at XLA's default level.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_COMPILE_FLAG

ROOT = Path(__file__).resolve().parents[1]

# Prints one JSON object {quantity: sha256 of its bytes}. Self-contained: it runs here and in
# the subprocess with the same inputs.
_SCRIPT = r'''
import hashlib, json
import jax, jax.numpy as jnp, numpy as np
import mxjax

def adversarial(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    special = np.array([0.0, -0.0, 0.25, 0.75, 1.25, 2.5, 5.0, 6.0, 7.0, 1e-40, -1e-42,
                        3.0e38, -3.4e38, np.inf, -np.inf, np.nan], np.float32)
    flat[: special.size] = special
    flat[special.size: 2 * special.size] = special * 2.0 ** -10
    return jnp.asarray(x)

def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()

a, b = adversarial((24, 72), 0), adversarial((72, 40), 1)
dims = (((1,), (0,)), ((), ()))
out = {}
for policy in ("mxfp4_all_h16", "mxfp4_all_sr", "nvfp4", "fp8"):  # H16, SR, E4M3 scales, FP8
    def loss(a, b, key):
        y = mxjax.dot_general(a, b, dims, policy=policy, key=key)
        return jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2), y
    f = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
    out["gemm " + policy] = digest(f(a, b, jax.random.key(3)))
for fmt in ("mxfp4", "nvfp4", "mxfp8_e4m3"):
    f = jax.jit(lambda x, fmt=fmt: (mxjax.quantize(x, fmt, 0), mxjax.fake_quantize(x, fmt, 1)))
    out["quantize " + fmt] = digest(f(a.astype(jnp.bfloat16)))
print("RESULT" + json.dumps(out))
'''


def _digests_here() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # the same source as the fresh process runs (ours, a constant of this module)
        exec(compile(_SCRIPT, "<compile-level script>", "exec"), {})  # noqa: S102
    return _parse(out.getvalue())


def _digests_in_a_fresh_process(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _parse(proc.stdout)


def _parse(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.long  # one fresh process, ~20 CPU-s
def test_backend_optimization_level_0_computes_the_same_bits():
    flags = os.environ.get("XLA_FLAGS", "").split()
    assert FAST_COMPILE_FLAG in flags  # the level this process (and the run) compiles at
    default_level = " ".join(f for f in flags
                             if not f.startswith("--xla_backend_optimization_level="))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=default_level)
    fast = _digests_here()
    default = _digests_in_a_fresh_process(env)
    assert len(fast) == 7
    assert fast == default
