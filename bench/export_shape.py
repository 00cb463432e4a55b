"""Shape of the emulated GEMMs that each platform gets, read from exported StableHLO.

For a ~1B-config (Llama 3.2-1B shapes) decoder layer's train step (loss, and
gradients w.r.t. the layer's parameters and its input; the optimizer adds no
GEMM), exported with ``jax.export`` for each platform from this machine
(abstract shapes only, no weights), prints per platform a table of the
quantized GEMMs: count, operand dtypes, precision, ``optimization_barrier``
count and block/tensor amax reductions, then a one-line verdict against the
targets before the table's last line.

    .venv/bin/python bench/export_shape.py [--platforms cpu,cuda,tpu] [--seq 2048]

Targets: cuda and tpu have zero quantized GEMMs with f32 operands at HIGHEST;
under the MXFP4 presets at most one optimization_barrier per quantized operand on
cuda (the GPU form's: XLA recomputes the rotation in the rounding pass instead of
materializing it, mxjax/emulation/in_place.py) and none on tpu (NVFP4/FP8 keep the
value-guarding barriers of their per-tensor division, see docs/NUMERICS.md).
CPU keeps f32 HIGHEST with per-stage barriers by design (fastest there,
bit-identical results).

Which dots count as the interceptor's GEMMs: `bench.costmodel.export_shape`.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("PYTHONPATH") and str(ROOT) not in sys.path:
    # With PYTHONPATH set, that checkout's mxjax is read (e.g. main's, for a before table).
    sys.path.insert(0, str(ROOT))

import jax

from bench.costmodel.export_shape import (
    PLATFORMS,
    POLICIES,
    ModuleShape,
    analyze,
    export_text,
    layer_train_step,
)


def table(platform: str, shapes: dict[str, ModuleShape]) -> list[str]:
    header = ("policy", "quantized GEMMs", "operands -> out @ precision (count)",
              "f32@HIGHEST", "barriers", "amax reductions", "TPU kernels")
    rows = [header]
    for name, s in shapes.items():
        dots = s.quantized if name != "bf16" else s.dots
        sigs = collections.Counter(d.signature for d in dots)
        sig_text = "; ".join(f"{k} ({v})" for k, v in sorted(sigs.items())) or "-"
        if name == "bf16":
            sig_text = f"all {len(dots)} dots, none quantized: {sig_text}"
        rows.append((name, str(len(s.quantized)), sig_text, str(s.f32_highest),
                     str(s.barriers), str(s.amax_reductions), str(s.tpu_kernels)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = [f"## {platform}"]
    for j, r in enumerate(rows):
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def verdict(platform: str, shapes: dict[str, ModuleShape]) -> str:
    quantized = {n: s for n, s in shapes.items() if n != "bf16"}
    highest = sum(s.f32_highest for s in quantized.values())
    if platform == "cpu":
        ok = all(len(s.quantized) == s.f32_highest for s in quantized.values())
        return (f"verdict (cpu): CPU form kept (f32 HIGHEST, per-stage barriers): "
                f"{'yes' if ok else 'NO'}")
    mx = {n: s for n, s in quantized.items() if n.startswith("mxfp4")}
    mx_barriers = sum(s.barriers for s in mx.values())
    allowed = sum(2 * len(s.quantized) for s in mx.values()) if platform == "cuda" else 0
    ok = highest == 0 and mx_barriers <= allowed
    total = sum(len(s.quantized) for s in quantized.values())
    return (f"verdict ({platform}): {highest} of {total} quantized GEMMs at f32 HIGHEST "
            f"(target 0), {mx_barriers} barriers under the MXFP4 presets (target <= "
            f"{allowed}: one per quantized operand on cuda) -> {'met' if ok else 'NOT met'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platforms", default=",".join(PLATFORMS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(argv)
    import mxjax
    from models.llama import LlamaConfig

    config = LlamaConfig.llama3_1b(n_layers=1, dtype="bfloat16", param_dtype="float32")
    print(f"jax {jax.__version__}; mxjax from {Path(mxjax.__file__).parent}; one Llama-3.2-1B "
          f"decoder layer (dim {config.dim}, ffn {config.ffn_dim}), batch {args.batch} x seq "
          f"{args.seq}, bf16 compute: loss + grads (params, input)", flush=True)
    for platform in [p.strip() for p in args.platforms.split(",") if p.strip()]:
        shapes = {}
        for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
            fn, fargs = layer_train_step(config, name, args.batch, args.seq)
            shapes[name] = analyze(export_text(fn, fargs, platform),
                                   quantized_policy=name != "bf16")
        lines = table(platform, shapes)
        print("\n".join(lines))
        print("  " + verdict(platform, shapes))
        print(f"  (exported with jax.export(platforms=[{platform!r}]) on "
              f"{jax.default_backend()}; abstract shapes, nothing run)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
