"""Compile the programs a device run timed, at the commit and jax that ran them, deviceless,
and commit what the calibrated model reads (`bench.costmodel.calibrated`): the optimized HLO
(gzipped) and the dump's counts (fusions' PTX instructions x threads, Triton calls' launches
and ptxas resources).

The compile runs in a subprocess with another checkout and Python (e.g. a detached worktree
of the commit that ran and the jax it ran, ``.venv-gpu-extra`` for jax 0.11.2); the counts
are read here (ptxas from Triton's NVIDIA backend: run this with ``.venv-aot``)::

    git worktree add --detach /work/wt/h200run 7544543
    .venv-aot/bin/python bench/costmodel/calibration_compile.py --checkout /work/wt/h200run \\
        --python .venv-gpu-extra/bin/python --run h200-2026-12-04-b \\
        --programs layer_8b:bf16,quantize_xla_row

Programs: ``layer_8b:<policy>`` (the Llama 3.1-8B layer's train step at seq 8192, fused
attention; ``<policy>+xla_quantizer`` replaces xla_fp8's Pallas quantizer by XLA's, as the
first H200 probe did), ``gemm_bf16``, ``gemm_xla_fp8`` (``mx_dot`` at 8192^3 from
pre-quantized MXFP4 operands), ``quantize_xla_row``/``_col``, ``quantize_pallas_row``/``_col``
(one bf16[8192, 14336] operand, H16 into FP8) and ``copy_bf16`` (x + 1 on it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Runs in the other checkout: argv = program, target, HLO out path, dump dir.
_COMPILE = r'''
import functools, sys
import jax, jax.numpy as jnp
try:
    from bench.costmodel import aot, programs
except ImportError:
    from bench import aot, programs
aot.use_cpu_host()
import mxjax
name, target, out, dump = sys.argv[1:5]
x = jax.ShapeDtypeStruct((8192, 14336), jnp.bfloat16)

def layer(policy):
    if policy.endswith("+xla_quantizer"):
        from mxjax import accelerator_mx_fp8
        accelerator_mx_fp8._as_2d = lambda view: None
        policy = policy[: -len("+xla_quantizer")]
    return programs.program("layer_8b", policy, attention_impl="fused")

def operand(axis):
    from mxjax import accelerator, accelerator_mx_fp8, policies
    op = policies.get("mxfp4_all_h16").fprop.lhs
    signs = mxjax.fixed_signs(0, 16)
    carrier = accelerator_mx_fp8.LHS_CARRIER
    def finish(w, ab):
        t = accelerator_mx_fp8.carrier_window(ab, op, carrier)[0]
        return accelerator_mx_fp8.encode_exact(w, t, carrier), None
    return lambda v: accelerator.mx_operand_values(
        accelerator.contraction_view(v, (), (axis,)), op, k_out=v.shape[axis],
        hadamard_size=16, signs=signs, key=None, finish=finish)[0], (x,)

def pallas(row):
    from mxjax import policies
    from mxjax.kernels import QuantSpec, fused_quantize
    op = policies.get("mxfp4_all_h16").fprop.lhs
    spec = QuantSpec(recipe=op, hadamard=16)
    signs = mxjax.fixed_signs(0, 16)
    kw = dict(row=spec, row_signs=signs) if row else dict(col=spec, col_signs=signs)
    return (lambda v: fused_quantize(v, value_dtype=jnp.float32, interpret=False,
                                     **kw)[0 if row else 1].codes), (x,)

def gemm(backend):
    s = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
    if backend == "bf16":
        return lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16), (s, s)
    from mxjax.kernels import mx_dot
    lq = jax.eval_shape(lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=1, scale_rule="even"), s)
    rq = jax.eval_shape(lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=0, scale_rule="even"), s)
    return functools.partial(mx_dot, backend=backend), (lq, rq)

builders = {"gemm_bf16": lambda: gemm("bf16"), "gemm_xla_fp8": lambda: gemm("xla_fp8"),
            "quantize_xla_row": lambda: operand(1), "quantize_xla_col": lambda: operand(0),
            "quantize_pallas_row": lambda: pallas(True),
            "quantize_pallas_col": lambda: pallas(False),
            "copy_bf16": lambda: ((lambda v: v + 1), (x,))}
fn, args = layer(name.split(":", 1)[1]) if name.startswith("layer_8b:") else builders[name]()
compiled = aot.compile_for(fn, args, target, {"xla_dump_to": dump, "xla_dump_emitter_re": "ptx"})
open(out, "w").write(compiled.as_text())
'''


def compile_program(checkout: Path, python: str, program: str, target: str, dump: Path,
                    extra_path: str = "") -> str:
    """The optimized HLO of ``program`` compiled in ``checkout`` by ``python``, its XLA dump
    written to ``dump``."""
    with tempfile.NamedTemporaryFile("r", suffix=".hlo.txt") as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(checkout), extra_path)
                                                          if p))
        proc = subprocess.run([python, "-c", _COMPILE, program, target, out.name, str(dump)],
                              check=False, cwd=checkout, env=env, capture_output=True,
                              text=True)
        if proc.returncode:
            raise SystemExit(f"{program}: the compile in {checkout} failed:\n"
                             f"{proc.stderr[-3000:]}")
        return Path(out.name).read_text()


def main(argv=None) -> int:
    from bench.costmodel import calibrated

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, required=True,
                    help="the checkout of the commit that ran (a detached worktree)")
    ap.add_argument("--python", required=True, help="the Python of the jax that ran")
    ap.add_argument("--run", required=True,
                    help="the measurement file's stem, e.g. h200-2026-12-04-b")
    ap.add_argument("--programs", required=True, help="comma list (module doc)")
    ap.add_argument("--extra-path", default="",
                    help="appended to the compile's PYTHONPATH (e.g. a folder holding the "
                         "nvidia cuDNN package, which fused attention needs)")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--out", type=Path, default=calibrated.COMPILED_DIR)
    args = ap.parse_args(argv)
    out = args.out / args.run
    out.mkdir(parents=True, exist_ok=True)
    for program in (p.strip() for p in args.programs.split(",") if p.strip()):
        with tempfile.TemporaryDirectory(prefix="calibration_compile_") as dump:
            text = compile_program(args.checkout.resolve(), args.python, program, args.target,
                                   Path(dump), args.extra_path)
            counts = calibrated.counts_from_dump(text, Path(dump))
        stem = out / program.replace(":", "_").replace("@", "_at_").replace("+", "_")
        with gzip.open(f"{stem}.hlo.txt.gz", "wt", encoding="utf-8") as fh:
            fh.write(text)
        Path(f"{stem}.counts.json").write_text(
            json.dumps(calibrated.counts_to_json(counts), indent=0, sort_keys=True) + "\n")
        print(f"{stem}: {len(counts.fusion_instructions)} fusions counted, "
              f"{len(counts.triton)} Triton calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
