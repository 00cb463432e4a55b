"""The quantize section: the quantize kernels' GB/s against the device copy bandwidth."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from bench.device.harness import SKIPPED, Pace, Sizes, Table, log, short_error, timeit


def quantize_section(table: Table, copy_bw: float | None, sz: Sizes, deadline: float) -> None:
    import mxjax
    from mxjax.kernels import QuantSpec, fused_quantize

    rows = table.section("Quantize MXFP4 (bf16 input; bytes = read + written)",
                         ("kernel", "shape", "GB/s", "of copy BW"))
    pace = Pace(deadline)
    r = c = sz.quant
    x = jax.random.normal(jax.random.key(1), (r, c), jnp.bfloat16)
    signs = mxjax.fixed_signs(0, 16)
    even = mxjax.OperandRecipe(fmt=mxjax.MXFP4, scale_rule="even")
    per_copy = r * c // 2 + r * c // 32

    def frac(gbs):
        return f"{gbs / copy_bw:6.1%}" if copy_bw else "(no ceilings)"

    cases = [
        ("fused row", {"row": QuantSpec(recipe=even)}, 1),
        ("fused row+col", {"row": QuantSpec(recipe=even),
                           "col": QuantSpec(recipe=even)}, 2),
        ("fused row H16", {"row": QuantSpec(recipe=even, hadamard=16),
                           "row_signs": signs}, 1),
        ("fused row+col H16", {"row": QuantSpec(recipe=even, hadamard=16),
                                   "col": QuantSpec(recipe=even, hadamard=16),
                                   "row_signs": signs, "col_signs": signs}, 2),
    ]
    def timed(name, fn, moved):
        """One row: fn jitted on x, `moved` bytes (read + written) per call."""
        if not pace.ok():
            rows.append((name, f"{r}x{c}", SKIPPED, ""))
            return
        t0 = time.perf_counter()
        try:
            gbs = moved / timeit(jax.jit(fn), x) / 1e9
            rows.append((name, f"{r}x{c}", f"{gbs:7.0f}", frac(gbs)))
        except Exception as e:  # noqa: BLE001 - a kernel that cannot lower is a row, not a crash
            rows.append((name, f"{r}x{c}", short_error(e), ""))
        pace.took(time.perf_counter() - t0)

    for name, kw, copies in cases:
        timed(name, functools.partial(fused_quantize, **kw), 2 * r * c + copies * per_copy)
    from mxjax import policies
    from mxjax.chips import target_chip
    from mxjax.emulation import in_place
    from mxjax.routes import xla_fp4
    from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt

    op = policies.get("mxfp4_all_h16").fprop.lhs
    nv_copy = r * c // 2 + r * c // 16  # E2M1 codes + per-16 scale bytes
    # The route's conversion on this chip: PTX's cvt on Blackwell, integer rounding before.
    e2m1_cvt = has_e2m1_cvt(target_chip("gpu").compute_capability)

    def fp4_kernel(v, axis, pair):
        return xla_fp4.kernel_operand(v, axis, op, hadamard_size=16, signs=None,
                                      k_out=v.shape[axis], pair=pair, e2m1_cvt=e2m1_cvt)

    def fp4_xla(v, axis):
        view = in_place.contraction_view(v, (), (axis,))
        return xla_fp4.in_place_operand(view, op, None, k_out=v.shape[axis],
                                        hadamard_size=16, signs=None)

    # The 'xla_fp4' route's operands (H16, NVFP4 re-encoding included): its one-pass
    # kernel (mxjax.routes.xla_fp4_kernel) against the XLA form it replaces on GPUs.
    fp4_cases = [
        ("fp4_operand row H16", functools.partial(fp4_kernel, axis=1, pair=False), 1),
        ("fp4_operand col H16", functools.partial(fp4_kernel, axis=0, pair=False), 1),
        ("fp4_operand pair H16", lambda v: fp4_kernel(v, 1, True)[:2] + fp4_kernel(
            v, 0, True)[:2], 2),
        ("XLA xla_fp4 operand row H16", functools.partial(fp4_xla, axis=1), 1),
        ("XLA xla_fp4 operand col H16", functools.partial(fp4_xla, axis=0), 1),
    ]
    for name, fn, copies in fp4_cases:
        timed(name, fn, 2 * r * c + copies * nv_copy)
    xla_cases = [
        ("XLA mxjax.quantize row",
         lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=1, scale_rule="even")),
        ("XLA hadamard16+quantize row", lambda v: mxjax.quantize(
            mxjax.hadamard(v, 16, axis=1, signs=signs), mxjax.MXFP4, axis=1, scale_rule="even")),
    ]
    for name, fn in xla_cases:
        timed(name, fn, 2 * r * c + per_copy)
    log("quantize section done")
