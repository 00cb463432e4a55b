"""Cost of the GPU form's quantize passes on one operand, from a deviceless compile.

Compiles `mxjax.emulation.in_place.mx_operand_values` (MXFP4 + H16, RNE, FP8 carrier as in
the 'xla_fp8' route, or bf16), or `xla_fp4`'s operand (in place, or by the one-pass
kernel), for a GPU without one, with XLA's dumps on, and gives per kernel the bytes it
moves, the elementwise ops in its HLO (`hlo_kernels`) and the PTX instructions its
threads execute (straight-line kernels: instructions in the entry times launched
threads; reductions' loops and divergent branches are counted once, so read those as a
floor) and the SASS instructions ptxas makes of that PTX (counted the same way; what the
chip executes: ptxas folds logic, shifts and adds, and turns one PTX conversion into one
or more); then a roofline estimate: per kernel max(bytes / HBM rate, SASS instructions /
ALU rate), the HBM rate the H200's measured copy (`mxjax/measurements.json`) or another
target's spec, the ALU rate one instruction per f32 lane per clock from the target's spec
(H200: 132 SMs x 128 lanes x 1.98 GHz).

`dump_dir()` must run before any JAX backend starts (XLA reads its flags then).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from mxjax import measurements

__all__ = ["OUTS", "KernelCost", "QuantizeCase", "dump_dir", "kernel_costs", "kernel_line",
           "total_line"]

# The copy bandwidth measured on the H200 (GB/s in the data file).
H200_COPY_BYTES_PER_S = measurements.figure("gemm_8192.h200.measured").value("copy") * 1e9
OUTS = ("f8", "f4", "bf16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeCase:
    """One operand's quantize: its shape, contraction axis, what it becomes and where.

    ``out``: 'f8' (the 'xla_fp8' lhs carrier), 'f4' (the 'xla_fp4' operand: E2M1 + E4M3
    scales, [F, K]) or 'bf16' (the emulation's values). ``barrier``: recompute the rotation
    behind a barrier (``recompute``). ``kernel``: 'f4' by the one-pass kernel
    (`mxjax.routes.xla_fp4_kernel`); ``pair``: both directions in one kernel;
    ``e2m1_cvt``: PTX's cvt to E2M1 where the target has it (else integer rounding).
    """

    shape: tuple[int, int] = (8192, 14336)
    axis: int = 1
    out: str = "f8"
    target: str = "h200"
    barrier: bool = True
    kernel: bool = False
    pair: bool = False
    e2m1_cvt: bool = True

    def __post_init__(self):
        if self.out not in OUTS:
            raise ValueError(f"out: expected one of {OUTS}, got {self.out!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelCost:
    """One kernel: its HLO name and shape, bytes moved, HLO ALU ops, the PTX and SASS
    instructions its threads execute, and its roofline time (s)."""

    name: str
    shape: str
    bytes: float
    alu_ops: float
    ptx_instructions: float
    sass_instructions: float
    estimate_s: float


def dump_dir() -> Path:
    """A fresh directory XLA dumps the compiled PTX into (sets ``XLA_FLAGS``: call before
    any JAX backend starts)."""
    dump = Path(tempfile.mkdtemp(prefix="quantize_cost_"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_emitter_re=ptx")
    return dump


def _quantize_fn(case: QuantizeCase, e2m1_cvt: bool):
    import mxjax
    from mxjax import policies
    from mxjax.emulation import in_place
    from mxjax.routes import xla_fp4, xla_fp8

    shape = case.shape
    op = policies.get("mxfp4_all_h16").fprop.lhs
    signs = mxjax.fixed_signs(0, 16)
    carrier = xla_fp8.LHS_CARRIER

    def finish(w, amax_bits):
        t = xla_fp8.carrier_window(amax_bits, op, carrier)[0]
        return xla_fp8.encode_exact(w, t, carrier), None

    def fn(v):
        view = in_place.contraction_view(v, (), (case.axis,))
        if case.out == "f4" and case.kernel:
            kw = {"hadamard_size": 16, "signs": signs, "pair": case.pair,
                  "e2m1_cvt": e2m1_cvt}
            if case.pair:  # both copies (the route takes each from the merged call)
                return tuple(xla_fp4.kernel_operand(v, axis, op, k_out=shape[axis], **kw)
                             for axis in (1, 0))
            return xla_fp4.kernel_operand(v, case.axis, op, k_out=shape[case.axis], **kw)
        if case.out == "f4":
            q, scales, _, exact = xla_fp4.in_place_operand(
                view, op, None, k_out=shape[case.axis], hadamard_size=16, signs=signs)
            return q, scales, exact
        out = in_place.mx_operand_values(
            view, op, k_out=shape[case.axis],
            hadamard_size=16, signs=signs, key=None, recompute=case.barrier,
            finish=finish if case.out == "f8" else None)
        return out[0] if case.out == "f8" else out

    return fn


def kernel_costs(case: QuantizeCase, dump: Path) -> list[KernelCost]:
    """Each kernel of `case`'s program compiled for its target, PTX and SASS read from
    `dump` (`dump_dir`)."""
    from bench.costmodel import aot

    aot.use_cpu_host()
    import jax
    import jax.numpy as jnp

    from bench.costmodel import hlo_kernels as hk
    from bench.costmodel.ptx_cost import ptx_kernels, sass_kernels

    target = aot.TARGETS[case.target]
    e2m1_cvt = False
    if case.kernel and case.e2m1_cvt:
        from mxjax.chips import compute_capability_of
        from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt

        e2m1_cvt = has_e2m1_cvt(compute_capability_of(target.description))
    compiled = aot.compile_for(_quantize_fn(case, e2m1_cvt),
                               (jax.ShapeDtypeStruct(case.shape, jnp.bfloat16),), case.target)
    ptx, sass = ptx_kernels(dump), sass_kernels(dump)
    hbm_bytes_per_s = (H200_COPY_BYTES_PER_S if case.target == "h200"
                       else target.hbm_bytes_per_s)
    costs = []
    for k in hk.kernels(compiled.as_text()):
        b = k.bytes_read + k.bytes_written
        name = k.name.replace(".", "_")
        if k.category == "custom-call" and name not in ptx:
            # a Pallas kernel's PTX entry has the kernel's name (xla_fp4_kernel.kernel_name)
            entries = [e for e in ptx if e.startswith("mxfp4_operand")]
            name = entries[0] if len(entries) == 1 else "mxfp4_operand"
        thr, ins = ptx.get(name, (0, 0))
        sass_ins = thr * sass.get(name, 0)
        costs.append(KernelCost(
            name=k.name, shape=k.shape, bytes=b, alu_ops=k.alu_ops,
            ptx_instructions=thr * ins, sass_instructions=sass_ins,
            estimate_s=max(b / hbm_bytes_per_s, sass_ins / target.alu_ops_per_s)))
    return costs


def kernel_line(k: KernelCost, n: int) -> str:
    """One kernel's row, per element of an operand of n elements."""
    return (f"  {k.name:48s} {k.bytes / 1e9:7.3f} GB  HLO alu/elem {k.alu_ops / n:6.2f}  "
            f"PTX/elem {k.ptx_instructions / n:7.2f}  SASS/elem {k.sass_instructions / n:7.2f}"
            f"  {k.shape[:48]}")


def total_line(case: QuantizeCase, costs: list[KernelCost]) -> str:
    """The totals of `case`'s kernels, per input element."""
    n = case.shape[0] * case.shape[1]

    def total(field: str) -> float:
        return sum((getattr(k, field) for k in costs), 0.0)

    return (f"{case.shape} axis {case.axis} -> {case.out}"
            f"{'' if case.barrier else ' (no barrier)'}: "
            f"{len(costs)} kernels, {total('bytes') / 1e9:.3f} GB, "
            f"HLO alu/elem {total('alu_ops') / n:.1f}, "
            f"PTX instr/elem {total('ptx_instructions') / n:.1f}, "
            f"SASS instr/elem {total('sass_instructions') / n:.1f}, "
            f"est {total('estimate_s') * 1e6:.0f} us")
