"""The ceilings section: device copy bandwidth and the bf16 GEMM's TFLOP/s."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.device.harness import SKIPPED, Sizes, Table, elapsed, log, timeit


def ceilings(table: Table, sz: Sizes, deadline: float) -> float | None:
    rows = table.section("Ceilings (measured)", ("what", "value"))
    if elapsed() > deadline:
        rows.append(("ceilings", SKIPPED))
        return None
    n = sz.copy_elems
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    t = timeit(copy, x)
    del x
    bw = 2 * 4 * n / t / 1e9
    rows.append(("device copy (read+write)", f"{bw:8.0f} GB/s"))
    s = sz.gemm_ceiling
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (s, s), jnp.bfloat16)
    b = jax.random.normal(k2, (s, s), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16))
    t = timeit(mm, a, b)
    del a, b
    tf = 2 * s**3 / t / 1e12
    rows.append((f"bf16 jnp.dot {s}^3", f"{tf:8.1f} TFLOP/s"))
    log(f"copy {bw:.0f} GB/s, bf16 GEMM {tf:.1f} TFLOP/s")
    return bw
