"""mxjax's native MXFP4 GEMM kernels, and XLA's block-scaled dot, compiled deviceless for GPUs.

For each GPU target (default: b200, sm_100a, native block-scaled FP4 MMA; h200,
sm_90a, FP8 tensor cores only) and path, one 4096^3 MXFP4 GEMM from packed
operands (E2M1 codes two per byte, E8M0 scales) is compiled and reported: whether
it lowers (a failure is a finding, with its first line), the kernels of the
optimized program, and which matrix instructions the kernel's PTX holds where
the PTX is available:

* ``triton``: the 'triton' backend's ``tl.dot_scaled`` kernel
  (``mxjax.kernels.triton_dot_scaled``) compiled by Triton for the target's compute
  capability, as jax-triton would (PTX inspected);
* ``triton_jax``: the same kernel lowered through jax-triton (``jt.triton_call``);
* ``xla_scaled_dot``: ``jax.nn.scaled_dot_general`` with the 'mxfp4' config (XLA/cuDNN's own
  block-scaled path), from bf16 operands;
* ``xla_scaled_matmul``: ``jax.nn.scaled_matmul`` on float4_e2m1fn operands and E8M0 scales.

    pip install -e '.[aot-gpu,gpu]' 'triton==3.9.0'
    python bench/native_fp4.py [--targets b200,h200] [--paths ...] [--size 4096]
    python bench/native_fp4.py --targets mi355x,mi300x --paths triton

AMD targets (``mi355x``: gfx950, block-scaled FP4 MFMA; ``mi300x``: gfx942, none) take
the ``triton`` path only: Triton's AMD backend (in every triton wheel) compiles the
kernel to AMDGCN without a GPU. XLA's deviceless ROCm compile needs the jax-rocm7 PJRT
plugin and the ROCm runtime libraries it links to, which pip does not install; the
other paths are reported as not tried (docs/PERFORMANCE.md, "MI355X (gfx950),
deviceless"). Counted in the AMDGCN: ``v_mfma_scale_f32_{32x32x64,16x16x128}_f8f6f4``
(gfx950's block-scaled MFMA), those with both operands E2M1 (``cbsz:4 blgp:4``), and
every other ``v_mfma``.

XLA's deviceless GPU compile writes no PTX (``xla_dump_to`` has the HLO and the
thunk sequence; the executable keeps the cubin compressed), so the PTX columns
are for the ``triton`` path. Counted: ``tcgen05.mma`` (Blackwell's 5th-generation
tensor cores) and its ``kind::mxf4 ... block_scale`` form, ``wgmma.mma_async``
(Hopper), ``mma.sync`` (older MMA), E2M1 converts and E4M3 operands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.costmodel import aot
from bench.costmodel.native_fp4 import (
    AMD_INSTRUCTIONS,
    AMD_TARGETS,
    DEFAULT_TARGETS,
    INSTRUCTIONS,
    PATHS,
    Result,
    amd_unavailable_reason,
    compile_path,
)

aot.use_cpu_host()  # before jax picks its platform

import jax


def table(results: list[Result]) -> list[str]:
    """The results as aligned text rows: a column per instruction counted (PTX labels for
    NVIDIA targets, AMDGCN labels for AMD ones; '-' where a row has no such count)."""
    labels = [label for label, _ in INSTRUCTIONS] if any(
        r.target not in AMD_TARGETS for r in results) else []
    if any(r.target in AMD_TARGETS for r in results):
        labels += [label for label, _ in AMD_INSTRUCTIONS]
    header = ("target", "path", "lowers", "GEMM kernels") + tuple(labels)
    rows = [header]
    for r in results:
        if not r.ok:
            rows.append((r.target, r.path, "NO: " + r.error, "") + ("",) * len(labels))
            continue
        names = ", ".join(dict.fromkeys(r.kernels)) or "-"
        counts = ("-",) * len(labels) if r.instructions is None else tuple(
            str(r.instructions.get(label, "-")) for label in labels)
        rows.append((r.target, r.path, "yes", names) + counts)
    widths = [min(max(len(row[i]) for row in rows), 90) for i in range(len(header))]
    out = []
    for j, row in enumerate(rows):
        out.append("  " + "  ".join(c[:90].ljust(w) for c, w in zip(row, widths)))
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args(argv)
    results = []
    for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
        if target in AMD_TARGETS:
            why = amd_unavailable_reason()
        elif aot.TARGETS[target].kind != "gpu":
            raise SystemExit(f"--targets: {target!r} is not a GPU target")
        else:
            why = aot.unavailable_reason(aot.TARGETS[target])
        if why:
            raise SystemExit(f"{target}: {why}")
        for path in [p.strip() for p in args.paths.split(",") if p.strip()]:
            r = compile_path(target, path, args.size)
            results.append(r)
            print(f"  {target} {path}: {'ok' if r.ok else r.error}", flush=True)
    print(f"\n## native MXFP4 GEMM paths, {args.size}^3, deviceless (jax {jax.__version__})")
    for line in table(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
