"""What `import mxjax` and the first quantized GEMM do to programs traced before them.

The first trace of a quantized GEMM traces its TPU form (`mxjax._platform.per_platform`),
whose kernel is a Pallas call. Had Pallas been imported only then, its config options
would join JAX's tracing context and every program traced before would miss the jit
cache and compile again (a user's bf16 baseline, recompiled after the first MXFP4 step).
`mxjax` imports Pallas with itself, so the context is fixed once `mxjax` is imported.
Checked in a fresh process: this test session imports Pallas early anyway.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    import mxjax
    plain = jax.jit(lambda x: jnp.sin(x) * 2)
    x = jnp.ones((8, 64))
    plain(x)
    dims = (((1,), (0,)), ((), ()))
    jax.jit(lambda a, b: mxjax.dot_general(a, b, dims, policy="mxfp4_all_h16"))(x, x.T)
    plain(x)
    print("CACHE", plain._cache_size())
""")


def test_first_quantized_gemm_does_not_invalidate_earlier_programs():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("CACHE")[-1].strip() == "1", proc.stdout
