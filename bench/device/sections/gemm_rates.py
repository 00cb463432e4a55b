"""The GEMM TFLOP/s table: operand types x accumulation setting x GEMM implementation.

Shapes: 8192^3 first, then the Llama 3.1-8B projections at 8192 tokens
(`bench.device.sections.gemm.GEMM_SHAPES`). Per shape:

* ``bf16``: bf16 x bf16 -> bf16;
* ``e4m3xe4m3`` and ``e5m2xe4m3``: f8 x f8 -> f32 (times two tensor scales, as the FP8
  routes run it) at precision DEFAULT (cuBLASLt fast accumulation) and HIGHEST
  (promoted accumulation), `mxjax.emulation.f8_accumulation`;
* on Blackwell (compute capability 10+): block-scaled ``mxfp8`` (E4M3, E8M0 scales per
  32) and ``nvfp4`` (E2M1, E4M3 scales per 16) by ``jax.nn.scaled_matmul`` (cuDNN), and
  ``mxfp4``: the forward GEMM of mxjax's 'xla_fp4' route, which quantizes its bf16
  operands in place and re-encodes them as NVFP4 (its time includes that). Elsewhere each is one row
  saying why it was skipped.

Each is compiled under each GEMM implementation XLA can be told to use, per compile
(``compile(compiler_options)``, not XLA_FLAGS): ``cublaslt`` (``xla_gpu_enable_triton_gemm
=false``) and ``triton`` (Triton GEMM fusions with no cuBLAS fallback,
``xla_gpu_cublas_fallback=false``). The implementation recorded is what the compiled HLO
holds (`implementation_of`), not what was asked for. Operands are made outside the timed
region; time is per call of `BATCH` calls issued back to back (one wait at the end, so that
the host's dispatch hides behind the device), the median of 3 batches after 2 warm-up calls.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from bench.costmodel.calibration import GemmRate
from bench.device.harness import Pace, Table, log, short_error
from bench.device.sections.gemm import GEMM_SHAPES

__all__ = ["IMPLEMENTATIONS", "gemm_rates_section", "implementation_of"]

# Compiler options per implementation asked for.
IMPLEMENTATIONS = {
    "cublaslt": {"xla_gpu_enable_triton_gemm": False},
    "triton": {"xla_gpu_enable_triton_gemm": True, "xla_gpu_cublas_fallback": False},
}
F8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SETTINGS = {"DEFAULT": lax.Precision.DEFAULT, "HIGHEST": lax.Precision.HIGHEST}
BLOCK_SCALED = ("mxfp8", "nvfp4", "mxfp4")
BATCH = 20


def seconds_per_call(fn, *args, batch: int = BATCH, batches: int = 3) -> float:
    """Median over `batches` of the seconds per call of `batch` calls issued back to back."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(batch):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / batch)
    return statistics.median(times)


def implementation_of(hlo_text: str) -> str:
    """'cudnn', 'cublaslt', 'triton' or 'unknown': what runs the GEMM of a compiled program."""
    if "__cudnn$" in hlo_text:
        return "cudnn"
    if "__cublas$lt$matmul" in hlo_text:
        return "cublaslt"
    if "__triton_gemm" in hlo_text or '"kind":"__triton' in hlo_text:
        return "triton"
    return "unknown"


def _f8_program(lhs: str, setting: str, m: int, n: int, k: int):
    def gemm(a, b, sa, sb):
        out = lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=SETTINGS[setting],
                              preferred_element_type=jnp.float32)
        return out * sa * sb

    k1, k2 = jax.random.split(jax.random.key(3))
    a = jax.random.normal(k1, (m, k), jnp.float32).astype(F8[lhs])
    b = jax.random.normal(k2, (k, n), jnp.float32).astype(F8["e4m3"])
    return gemm, (a, b, jnp.float32(1.0), jnp.float32(1.0))


def _bf16_program(m: int, n: int, k: int):
    k1, k2 = jax.random.split(jax.random.key(2))
    a = jax.random.normal(k1, (m, k), jnp.bfloat16)
    b = jax.random.normal(k2, (k, n), jnp.bfloat16)
    return (lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16)), (a, b)


def _scaled_program(kind: str, m: int, n: int, k: int):
    """jax.nn.scaled_matmul's operands: [1, M, K] x [1, N, K] with scales along K."""
    elem, scale, block = {"mxfp8": (jnp.float8_e4m3fn, jnp.float8_e8m0fnu, 32),
                          "nvfp4": (jnp.float4_e2m1fn, jnp.float8_e4m3fn, 16)}[kind]
    k1, k2 = jax.random.split(jax.random.key(4))
    a = jax.random.uniform(k1, (1, m, k), jnp.float32, -4, 4).astype(elem)
    b = jax.random.uniform(k2, (1, n, k), jnp.float32, -4, 4).astype(elem)
    sa = jnp.ones((1, m, k // block), scale)
    sb = jnp.ones((1, n, k // block), scale)
    return (lambda a, b, sa, sb: jax.nn.scaled_matmul(a, b, sa, sb, jnp.bfloat16)), (a, b, sa, sb)


def _mxfp4_program(m: int, n: int, k: int):
    """The forward GEMM of MXFP4 x MXFP4 on the 'xla_fp4' route (its in-place quantize
    of both bf16 operands included: the route quantizes canonical operands itself)."""
    import mxjax
    from mxjax import policies

    policy = policies.get("mxfp4_all").with_backend("xla_fp4")

    def gemm(a, b):
        return mxjax.dot_general(a, b, (((1,), (0,)), ((), ())), policy=policy,
                                 preferred_element_type=jnp.bfloat16)

    return gemm, _bf16_program(m, n, k)[1]


def _blackwell_reason(compute_capability, dry_run: bool) -> str:
    """'' where the block-scaled rows run; else why not."""
    if dry_run:
        return ""  # the code path runs on CPU (XLA expands the block-scaled dot)
    if compute_capability is None or compute_capability[0] < 10:
        return (f"needs Blackwell's block-scaled MMA (compute capability 10+), device has "
                f"{compute_capability}")
    return ""


def _cases(m: int, n: int, k: int):
    """(operands, setting, implementation asked or None, builder) in the table's order."""
    for impl in IMPLEMENTATIONS:
        yield "bf16", "DEFAULT", impl, lambda: _bf16_program(m, n, k)
    for lhs in ("e4m3", "e5m2"):
        for setting in SETTINGS:
            for impl in IMPLEMENTATIONS:
                yield (f"{lhs}xe4m3", setting, impl,
                       lambda lhs=lhs, s=setting: _f8_program(lhs, s, m, n, k))
    for kind in ("mxfp8", "nvfp4"):
        yield kind, "block-scaled", None, lambda kind=kind: _scaled_program(kind, m, n, k)
    yield "mxfp4", "xla_fp4 (quantize included)", None, lambda: _mxfp4_program(m, n, k)


def gemm_rates_section(table: Table, *, deadline: float, shape_div: int, shapes: int,
                       compute_capability, dry_run: bool) -> list[GemmRate]:
    """Measures the table (see the module doc) until `deadline`; returns the rates."""
    rows = table.section("GEMM TFLOP/s per operands, setting and implementation",
                         ("shape", "operands", "setting", "asked", "ran on", "TFLOP/s",
                          "vs bf16"))
    pace = Pace(deadline)
    out: list[GemmRate] = []
    blackwell = _blackwell_reason(compute_capability, dry_run)
    if blackwell:
        rows.append(f"mxfp8, nvfp4, mxfp4: skipped: {blackwell}")
        log(f"gemm rates: block-scaled rows skipped: {blackwell}")
    for name, m, n, k in GEMM_SHAPES[:shapes]:
        m, n, k = m // shape_div, n // shape_div, k // shape_div
        label = f"{name} {m}x{n}x{k}"
        bf16 = None
        for operands, setting, asked, build in _cases(m, n, k):
            if operands in BLOCK_SCALED and blackwell:
                continue
            if not pace.ok():
                rows.append((label, operands, setting, asked or "-", "skipped (time budget)"))
                continue
            t0 = time.perf_counter()
            try:
                fn, args = build()
                options = IMPLEMENTATIONS.get(asked) if asked else None
                compiled = jax.jit(fn).lower(*args).compile(options)
                ran = implementation_of(compiled.as_text())
                tflops = 2 * m * n * k / seconds_per_call(compiled, *args) / 1e12
                if operands == "bf16" and bf16 is None:
                    bf16 = tflops
                out.append(GemmRate(operands=operands, m=m, n=n, k=k, implementation=ran,
                                    setting=setting if asked in (None, ran)
                                    else f"{setting}, asked {asked}",
                                    tflops=tflops))
                rows.append((label, operands, setting, asked or "-", ran, f"{tflops:8.4g}",
                             f"{tflops / bf16:5.2f}x" if bf16 else ""))
                log(f"gemm {label} {operands} {setting} asked {asked}: {ran} {tflops:.4g} "
                    "TFLOP/s")
            except Exception as e:  # noqa: BLE001 - one GEMM's failure is its row
                rows.append((label, operands, setting, asked or "-", short_error(e, 70)))
                log(f"gemm {label} {operands} {setting} {asked}: {short_error(e)}")
            finally:
                pace.took(time.perf_counter() - t0)
    return out
