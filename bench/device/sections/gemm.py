"""The gemm section: MXFP4 GEMM TFLOP/s per backend against bf16 ``jnp.dot``."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from bench.device.harness import SKIPPED, Pace, Sizes, Table, log, short_error, timeit

GEMM_SHAPES = [  # (name, M, N, K); M = 8192 tokens
    ("8192^3", 8192, 8192, 8192),
    ("8B qkv", 8192, 6144, 4096),
    ("8B o", 8192, 4096, 4096),
    ("8B gate/up", 8192, 14336, 4096),
    ("8B down", 8192, 4096, 14336),
]
GEMM_BACKENDS = "xla,triton,xla_fp8"


def gemm_section(table: Table, sz: Sizes, deadline: float, backends: list[str]) -> None:
    import mxjax
    from mxjax.backends import capabilities, mx_dot

    caps = capabilities()
    rows = table.section(
        "MXFP4 GEMM TFLOP/s (ratio to bf16 jnp.dot)",
        ("shape", "bf16 dot") + tuple(backends))
    pace = Pace(deadline)
    for name, m, n, k in GEMM_SHAPES[: sz.gemm_shapes]:
        m, n, k = m // sz.gemm_div, n // sz.gemm_div, k // sz.gemm_div
        label = f"{name} {m}x{n}x{k}"
        if not pace.ok():
            rows.append((label, SKIPPED) + ("",) * len(backends))
            continue
        t0 = time.perf_counter()
        k1, k2 = jax.random.split(jax.random.key(2))
        a = jax.random.normal(k1, (m, k), jnp.bfloat16)
        b = jax.random.normal(k2, (k, n), jnp.bfloat16)
        flops = 2 * m * n * k
        t_bf16 = timeit(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16)),
                        a, b)
        bf = flops / t_bf16 / 1e12
        lq = jax.jit(lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=1, scale_rule="even"))(a)
        rq = jax.jit(lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=0, scale_rule="even"))(b)
        del a, b
        pace.took(time.perf_counter() - t0)
        cells = [f"{bf:6.1f}"]
        for be in backends:
            if not pace.ok():
                cells.append(SKIPPED)
                continue
            t0 = time.perf_counter()
            try:  # caps.reason raises ValueError for a backend this mxjax does not know
                if not caps.can_run(be):
                    cells.append(f"n/a ({caps.reason(be)[:40]})")
                    continue
                t = timeit(jax.jit(functools.partial(mx_dot, backend=be)), lq, rq,
                           iters=5 if be == "xla" else 10)
                tf = flops / t / 1e12
                cells.append(f"{tf:6.1f} ({tf / bf:4.2f}x)")
            except Exception as e:  # noqa: BLE001 - reported in the table
                cells.append(short_error(e, limit=72))
            finally:
                pace.took(time.perf_counter() - t0)
        del lq, rq
        rows.append((label,) + tuple(cells))
        log(f"GEMM {name}: " + " | ".join(cells))
    try:
        if "triton" in backends and not caps.can_run("triton"):
            rows.append(f"triton: {caps.reason('triton')}")
    except ValueError:
        pass
