"""All-gather bytes of the train step under FSDP, per policy, compiled without a device.

The Llama 3.1-8B config with one layer (remat, fused attention, bf16 compute, f32 master
weights), on a mesh of ``--devices`` devices all on ``fsdp`` (``(data 1, fsdp N, tensor
1)``), a global batch of N sequences of ``--seq`` tokens, compiled with the project's own
train step, state layout and partition rules (`train.step.make_train_step`,
`train.state.make_state_layout`) for ``--target``'s topology (a host of N GPUs, or N CPU
devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``). Prints, per policy,
the bytes of every all-gather's result in the optimized HLO (the embedding's and the
head's left out: they are unquantized): those a step runs when every operand's scale window
is exact (outside conditionals and in the block-scaled branches) and their ratio to bf16's,
those only the routes' emulation fallbacks run (`gathers_by_path`), the program's total,
count and largest. Issue 48's target: <= 0.55x bf16 under ``mxfp4_all_h16`` and ``nvfp4``.

    .venv-aot/bin/python bench/fsdp_gathers.py --target b200 --devices 8 --seq 2048 \\
        --policies bf16,fp8,mxfp4_all_h16,mxfp4_all_h16@auto,nvfp4@auto
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.costmodel import aot, hlo_kernels

aot.use_cpu_host()

# Bytes per element of the dtypes an all-gather result may have.
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
          "f4e2m1fn": 0.5, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_GATHER = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (all-gather-start|all-gather)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _bytes(arrays) -> float:
    size = 0.0
    for dt, dims in arrays:
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        size += n * _BYTES.get(dt, 0)
    return size


def _gather(line: str, skip_dim: int | None) -> tuple[str, float] | None:
    """(result shape, bytes) of the all-gather on `line`, if it holds one (and not skipped)."""
    m = _GATHER.match(line)
    if not m:
        return None
    arrays = _ARRAY.findall(m.group(2))
    if m.group(3) == "all-gather-start":
        arrays = arrays[-1:]
    if skip_dim is not None and any(str(skip_dim) in dims.split(",") for _, dims in arrays):
        return None
    return " ".join(f"{dt}[{dims}]" for dt, dims in arrays), _bytes(arrays)


def gathers(hlo_text: str, skip_dim: int | None = None) -> list[tuple[str, float]]:
    """(result shape, bytes) of every all-gather of an optimized HLO module; an async
    start's result is the last array of its tuple. ``skip_dim``: leave out gathers whose
    result has a dimension of that size (the vocabulary's)."""
    return [g for line in hlo_text.splitlines() if (g := _gather(line, skip_dim))]


def gathers_by_path(hlo_text: str, skip_dim: int | None = None) -> dict[str, list]:
    """`gathers` split by where each runs: ``'always'`` (outside every conditional),
    ``'exact'`` (in a conditional's true branch, or an indexed one's last: ``lax.cond``'s
    true one, where mxjax's routes put the block-scaled GEMM, `mxjax.routes.xla_fp4`) and
    ``'fallback'`` (in another branch: the emulation those routes take when an operand's
    scale window is not exact, or holds NaN). A computation called from a branch takes
    its path; inside a fallback branch everything is fallback. The module is read by
    `bench.costmodel.hlo_kernels.parse_module`."""
    module = hlo_kernels.parse_module(hlo_text)
    out: dict[str, list] = {"always": [], "exact": [], "fallback": []}
    seen: set[tuple[str, str]] = set()
    stack = [(module.entry, "always")]
    while stack:
        name, path = stack.pop()
        if (name, path) in seen or name not in module.computations:
            continue
        seen.add((name, path))
        for inst in module.computations[name]:
            if inst.opcode in ("all-gather", "all-gather-start"):
                arrays = _ARRAY.findall(inst.shape)[-1:] if inst.opcode.endswith("start") \
                    else _ARRAY.findall(inst.shape)
                if skip_dim is None or not any(str(skip_dim) in d.split(",") for _, d in arrays):
                    out[path].append((" ".join(f"{t}[{d}]" for t, d in arrays), _bytes(arrays)))
            branches = _branches(inst.attributes)
            for callee in inst.called:
                branch = branches.get(callee)
                stack.append((callee, path if branch is None or path == "fallback" else branch))
    return out


def _branches(attributes: str) -> dict[str, str]:
    """{branch computation: 'exact' or 'fallback'} of a conditional's attributes."""
    out = {n: ("exact" if kind == "true" else "fallback")
           for kind, n in re.findall(r"\b(true|false)_computation=%?([\w.\-]+)", attributes)}
    m = re.search(r"branch_computations=\{([^}]*)\}", attributes)
    if m:
        names = [n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip()]
        out.update({n: "exact" if i == len(names) - 1 else "fallback"
                    for i, n in enumerate(names)})
    return out


def compile_step(target: str, devices: int, seq: int, policy_name: str) -> str:
    """The optimized HLO text of the one-layer 8B train step under `policy_name`."""
    from bench.costmodel.train_memory import compile_train_step
    from models.llama import LlamaConfig
    from mxjax import policies

    mc = LlamaConfig.llama3_8b(n_layers=1, max_seq_len=seq, remat=True,
                               attention_impl="fused", dtype="bfloat16",
                               param_dtype="float32")
    policy = None if policy_name == "bf16" else policies.get(policy_name)
    return compile_train_step(mc, seq_len=seq, micro_batch=devices,
                              mesh_shape=(1, devices, 1), target_name=target,
                              policy=policy).as_text()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="b200", help="an aot target: b200, h100, cpu, ...")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--policies", default="bf16,fp8,mxfp4_all_h16,mxfp4_all_h16@auto,nvfp4@auto")
    args = ap.parse_args(argv)
    from models.llama import LlamaConfig

    vocab = LlamaConfig.llama3_8b().vocab_size
    base = None
    for name in args.policies.split(","):
        t0 = time.perf_counter()
        paths = gathers_by_path(compile_step(args.target, args.devices, args.seq, name), vocab)
        rows = [g for path in paths.values() for g in path]
        total = sum(b for _, b in rows)
        step = sum(b for path in ("always", "exact") for _, b in paths[path])
        fallback = sum(b for _, b in paths["fallback"])
        base = step if name == "bf16" else base
        largest = max((b for _, b in rows), default=0) / 2 ** 20
        ratio = f", {step / base:.2f}x bf16" if base else ""
        print(f"{args.target} x{args.devices} seq {args.seq} {name}: a step gathers "
              f"{step / 1e9:.3f} GB{ratio} (fallback branches {fallback / 1e9:.3f} GB more; "
              f"the program {total / 1e9:.3f} GB in {len(rows)}, largest {largest:.1f} MiB) "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)

if __name__ == "__main__":
    main()
