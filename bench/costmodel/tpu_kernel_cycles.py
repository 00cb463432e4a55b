"""Static cycle estimates of mxjax's TPU kernels, from libtpu's static LLO profile.

XLA's TPU ``cost_analysis()`` leaves Pallas (Mosaic) kernels out of
``optimal_seconds`` and ``bytes accessed``. libtpu can write a static cycle
estimate per compiled op (``--xla_jf_dump_static_llo_profile_to``); on whole
programs that flag is impractical here (one op of the emulated GEMMs made it
run for minutes and grow past 5 GB), so each kernel is compiled on its own, in
this separate process (the flag is read when libtpu starts):

    python bench/costmodel/tpu_kernel_cycles.py v5e < specs.json   # prints JSON

Input: a JSON list of `mxjax.emulation.in_place_tpu.KernelSpec` as dicts (the recipe as
``{"fmt", "scale_rule", "rounding", "sr_prescale"}``). Output: ``{"cycles":
[...], "clock_hz": f}``. The clock is calibrated from the profile of a bf16
4096^3 GEMM: ``clock = published bf16 peak / (GEMM flops / GEMM cycles)`` (a GEMM
at its peak rate per cycle; it overestimates the clock by the GEMM's inefficiency,
~2% on v5e).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

_DUMP = tempfile.mkdtemp(prefix="mxjax_llo_")
os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                  f" --xla_jf_dump_static_llo_profile_to={_DUMP}").strip()
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.costmodel import aot

aot.use_cpu_host()

import jax
import jax.numpy as jnp

_CYCLES_RE = re.compile(r"estimated_cycles: (\d+)")


def op_cycles(fn, args, target: str) -> dict[str, int]:
    """{op name: static cycles} of every op libtpu profiles in fn compiled for target."""
    for f in glob.glob(os.path.join(_DUMP, "*")):
        os.remove(f)
    aot.compile_for(fn, args, target)
    return {Path(f).name.split("_TPU")[0]: sum(int(m) for m in _CYCLES_RE.findall(
        Path(f).read_text())) for f in glob.glob(os.path.join(_DUMP, "*"))}


def remove_dump() -> None:
    """Deletes the profile directory (at the end of the process)."""
    shutil.rmtree(_DUMP, ignore_errors=True)


def _cycles_of(fn, args, target: str) -> int:
    return sum(op_cycles(fn, args, target).values())


KERNEL_OP = "_pallas_values"  # the name XLA gives the kernel's custom call (and its fusions)


def _kernel_op_cycles(fn, args, target: str) -> int:
    """Cycles of the one kernel op in fn's program (layout copies of the harness left out)."""
    cycles = op_cycles(fn, args, target)
    kernels = [c for name, c in cycles.items() if name.startswith(KERNEL_OP)]
    if len(kernels) != 1:
        raise RuntimeError(f"expected one {KERNEL_OP} op in the profile, got {sorted(cycles)}")
    return kernels[0]


def spec_to_json(spec) -> dict:
    op = spec.op
    return {"a": spec.a, "k": spec.k, "b": spec.b, "dtype": spec.dtype,
            "op": {"fmt": op.fmt.name, "scale_rule": op.scale_rule.value,
                   "rounding": op.rounding.value, "sr_prescale": op.sr_prescale},
            "hadamard_size": spec.hadamard_size, "has_signs": spec.has_signs,
            "has_uniforms": spec.has_uniforms, "bf16_cast": spec.bf16_cast}


def kernel_cycles(spec: dict, target: str) -> int:
    import mxjax
    from mxjax.emulation import in_place_tpu

    op = mxjax.OperandRecipe(**spec["op"])
    h = spec["hadamard_size"]
    shape = (spec["a"], spec["k"], spec["b"])
    # The lane case (b == 1) as the 2-D array programs hand it over: a trailing axis of 1
    # would make XLA relayout an f32 operand before the kernel (a copy no program has).
    arg_shape = shape[:2] if spec["b"] == 1 else shape
    args = [jax.ShapeDtypeStruct(arg_shape, jnp.dtype(spec["dtype"]))]
    if spec["has_signs"]:
        args.append(jax.ShapeDtypeStruct((h,), jnp.float32))
    if spec["has_uniforms"]:
        args.append(jax.ShapeDtypeStruct(arg_shape, jnp.float32))

    def fn(x, *rest):
        rest = list(rest)
        signs = rest.pop(0) if spec["has_signs"] else None
        u = rest.pop(0) if spec["has_uniforms"] else None
        return in_place_tpu.mx_values_tpu(x.reshape(shape), op, hadamard_size=h, signs=signs,
                                             u=None if u is None else u.reshape(shape),
                                             bf16_cast=spec.get("bf16_cast", False))

    return _kernel_op_cycles(fn, tuple(args), target)


def clock_hz(target: str) -> float:
    n = 4096
    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
    cycles = _cycles_of(lambda x, y: x @ y, (a, a), target)
    return aot.TARGETS[target].bf16_flops_per_s / (2 * n**3 / cycles)


def main() -> int:
    target = sys.argv[1]
    specs = json.load(sys.stdin)
    try:
        out = {"clock_hz": clock_hz(target), "cycles": [kernel_cycles(s, target) for s in specs]}
    finally:
        remove_dump()
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
