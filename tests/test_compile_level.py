"""The default test run compiles at XLA's backend optimization level 0 (tests/conftest.py).

That choice is only sound if it cannot change a result. This compares, bit for bit, the
quantized GEMMs (forward values and both gradients) and the quantizers, on adversarial
inputs (ties, zeros, subnormals, saturation, NaN, Inf, K not a multiple of 32), compiled at
level 0 (in this process in the default run, else in a fresh one) and in a fresh process at
XLA's default level. The default run checks two policies and the quantizers, the slow run
the other two.
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
for policy in POLICIES:
    def loss(a, b, key):
        y = mxjax.dot_general(a, b, dims, policy=policy, key=key)
        return jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2), y
    f = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
    out["gemm " + policy] = digest(f(a, b, jax.random.key(3)))
for fmt in FORMATS:
    f = jax.jit(lambda x, fmt=fmt: (mxjax.quantize(x, fmt, 0), mxjax.fake_quantize(x, fmt, 1)))
    out["quantize " + fmt] = digest(f(a.astype(jnp.bfloat16)))
print("RESULT" + json.dumps(out))
'''


def _script(policies: tuple[str, ...], formats: tuple[str, ...]) -> str:
    return f"POLICIES, FORMATS = {policies!r}, {formats!r}\n" + _SCRIPT


def _digests_here(script: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # the same source as the fresh process runs (ours, built in this module)
        exec(compile(script, "<compile-level script>", "exec"), {})  # noqa: S102
    return _parse(out.getvalue())


def _digests_in_a_fresh_process(script: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _parse(proc.stdout)


def _parse(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("policies, formats", [
    # H16 with E8M0 scales; NVFP4's E4M3 block scales, per-tensor factor and keyed
    # randomness; all three quantizer formats
    pytest.param(("mxfp4_all_h16", "nvfp4"), ("mxfp4", "nvfp4", "mxfp8_e4m3"),
                 marks=pytest.mark.long),
    # stochastic rounding, per-tensor FP8
    pytest.param(("mxfp4_all_sr", "fp8"), (), marks=pytest.mark.slow),
])
def test_backend_optimization_level_0_computes_the_same_bits(policies, formats):
    flags = os.environ.get("XLA_FLAGS", "").split()
    default_level = " ".join(f for f in flags
                             if not f.startswith("--xla_backend_optimization_level="))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=default_level)
    script = _script(policies, formats)
    if FAST_COMPILE_FLAG in flags:  # the default run: this process compiles at level 0
        fast = _digests_here(script)
    else:  # make test-slow compiles at XLA's default level: level 0 in a fresh process
        fast = _digests_in_a_fresh_process(
            script, dict(env, XLA_FLAGS=f"{default_level} {FAST_COMPILE_FLAG}".strip()))
    default = _digests_in_a_fresh_process(script, env)
    assert len(fast) == len(policies) + len(formats)
    assert fast == default
