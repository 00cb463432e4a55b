"""Cost of the GPU form's quantize passes on one operand, from a deviceless compile.

Compiles `mxjax.emulation.in_place.mx_operand_values` (MXFP4 + H16, RNE, FP8 carrier as in
the 'xla_fp8' route, or bf16) for an H200 without one, with XLA's dumps on, and
prints per kernel the bytes it moves, the elementwise ops in its HLO
(`bench.costmodel.hlo_kernels`) and the PTX instructions its threads execute (straight-line
kernels: instructions in the entry times launched threads; reductions' loops and
divergent branches are counted once, so read those as a floor) and the SASS
instructions ptxas makes of that PTX (counted the same way; what the chip executes:
ptxas folds logic, shifts and adds, and turns one PTX conversion into one or more),
then the totals per input element and a roofline estimate: per kernel max(bytes / HBM
rate, SASS instructions / ALU rate), the HBM rate the H200's measured copy (3.2e12 B/s)
or another target's spec, the ALU rate one instruction per f32 lane per clock from the
target's spec (H200: 132 SMs x 128 lanes x 1.98 GHz).

    .venv-aot/bin/python bench/quantize_cost.py [--shape 8192,14336] [--axis 1]
        [--out f8|f4|bf16] [--kernel [--pair] [--no-e2m1-cvt]] [--no-barrier]
        [--target h200|b200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H200_COPY_BYTES_PER_S = 3.2e12  # measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192,14336")
    ap.add_argument("--axis", type=int, default=1, help="the contraction axis")
    ap.add_argument("--out", choices=("f8", "f4", "bf16"), default="f8",
                    help="f8: the 'xla_fp8' lhs carrier; f4: the 'xla_fp4' operand "
                         "(E2M1 + E4M3 scales, [F, K]); bf16: the emulation's values")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--no-barrier", action="store_true", help="recompute=False")
    ap.add_argument("--kernel", action="store_true",
                    help="--out f4 by the one-pass kernel (mxjax.routes.xla_fp4_kernel)")
    ap.add_argument("--pair", action="store_true",
                    help="with --kernel: both directions in one kernel (the route's pairs)")
    ap.add_argument("--no-e2m1-cvt", action="store_true",
                    help="with --kernel: round by integer arithmetic even where the target "
                         "has PTX's cvt to E2M1 (the route uses the cvt there)")
    args = ap.parse_args(argv)
    dump = Path(tempfile.mkdtemp(prefix="quantize_cost_"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_emitter_re=ptx")
    from bench.costmodel import aot

    aot.use_cpu_host()
    import jax
    import jax.numpy as jnp

    import mxjax
    from bench.costmodel import hlo_kernels as hk
    from bench.costmodel.ptx_cost import ptx_kernels, sass_kernels
    from mxjax import policies
    from mxjax.emulation import in_place
    from mxjax.routes import xla_fp4, xla_fp8

    shape = tuple(int(s) for s in args.shape.split(","))
    op = policies.get("mxfp4_all_h16").fprop.lhs
    signs = mxjax.fixed_signs(0, 16)
    carrier = xla_fp8.LHS_CARRIER
    e2m1_cvt = False
    if args.kernel and not args.no_e2m1_cvt:
        from mxjax.chips import compute_capability_of
        from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt

        e2m1_cvt = has_e2m1_cvt(compute_capability_of(aot.TARGETS[args.target].description))

    def finish(w, amax_bits):
        t = xla_fp8.carrier_window(amax_bits, op, carrier)[0]
        return xla_fp8.encode_exact(w, t, carrier), None

    def fn(v):
        view = in_place.contraction_view(v, (), (args.axis,))
        if args.out == "f4" and args.kernel:
            kw = {"hadamard_size": 16, "signs": signs, "pair": args.pair,
                  "e2m1_cvt": e2m1_cvt}
            if args.pair:  # both copies (the route takes each from the merged call)
                return tuple(xla_fp4.kernel_operand(v, axis, op, k_out=shape[axis], **kw)
                             for axis in (1, 0))
            return xla_fp4.kernel_operand(v, args.axis, op, k_out=shape[args.axis], **kw)
        if args.out == "f4":
            q, scales, _, exact = xla_fp4.in_place_operand(
                view, op, None, k_out=shape[args.axis], hadamard_size=16, signs=signs)
            return q, scales, exact
        out = in_place.mx_operand_values(
            view, op, k_out=shape[args.axis],
            hadamard_size=16, signs=signs, key=None, recompute=not args.no_barrier,
            finish=finish if args.out == "f8" else None)
        return out[0] if args.out == "f8" else out

    compiled = aot.compile_for(fn, (jax.ShapeDtypeStruct(shape, jnp.bfloat16),), args.target)
    ks = hk.kernels(compiled.as_text())
    ptx = ptx_kernels(dump)
    sass = sass_kernels(dump)
    target = aot.TARGETS[args.target]
    hbm_bytes_per_s = H200_COPY_BYTES_PER_S if args.target == "h200" else target.hbm_bytes_per_s
    n = shape[0] * shape[1]
    tot_b = tot_alu = tot_ptx = tot_sass = est = 0.0
    for k in ks:
        b = k.bytes_read + k.bytes_written
        name = k.name.replace(".", "_")
        if k.category == "custom-call" and name not in ptx:
            name = "mxfp4_operand"  # a Pallas kernel's PTX entry has the kernel's name
        thr, ins = ptx.get(name, (0, 0))
        sass_ins = thr * sass.get(name, 0)
        tot_b, tot_alu, tot_ptx = tot_b + b, tot_alu + k.alu_ops, tot_ptx + thr * ins
        tot_sass += sass_ins
        est += max(b / hbm_bytes_per_s, sass_ins / target.alu_ops_per_s)
        print(f"  {k.name:48s} {b / 1e9:7.3f} GB  HLO alu/elem {k.alu_ops / n:6.2f}  "
              f"PTX/elem {thr * ins / n:7.2f}  SASS/elem {sass_ins / n:7.2f}  {k.shape[:48]}")
    print(f"{shape} axis {args.axis} -> {args.out}{' (no barrier)' if args.no_barrier else ''}: "
          f"{len(ks)} kernels, {tot_b / 1e9:.3f} GB, HLO alu/elem {tot_alu / n:.1f}, "
          f"PTX instr/elem {tot_ptx / n:.1f}, SASS instr/elem {tot_sass / n:.1f}, "
          f"est {est * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
