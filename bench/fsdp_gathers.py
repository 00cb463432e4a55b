"""All-gather bytes of the train step under FSDP, per policy, compiled without a device.

The Llama 3.1-8B config with one layer (remat, fused attention, bf16 compute, f32 master
weights), on a mesh of ``--devices`` devices all on ``fsdp`` (``(data 1, fsdp N, tensor
1)``), a global batch of N sequences of ``--seq`` tokens, compiled with the project's own
train step, state layout and partition rules (`train.step.make_train_step`,
`train.state.make_state_layout`) for ``--target``'s topology (a host of N GPUs, or N CPU
devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``). Prints, per policy,
the bytes of every all-gather's result in the optimized HLO (the embedding's and the
head's left out: they are unquantized), their count, the largest, and the ratio to
bf16's. Issue 48's target: <= 0.55x bf16 under ``mxfp4_all_h16`` and ``nvfp4``.

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

from bench.costmodel import aot

aot.use_cpu_host()

# Bytes per element of the dtypes an all-gather result may have.
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
          "f4e2m1fn": 0.5, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_GATHER = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (all-gather-start|all-gather)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def gathers(hlo_text: str, skip_dim: int | None = None) -> list[tuple[str, float]]:
    """(result shape, bytes) of every all-gather of an optimized HLO module; an async
    start's result is the last array of its tuple. ``skip_dim``: leave out gathers whose
    result has a dimension of that size (the vocabulary's)."""
    out = []
    for line in hlo_text.splitlines():
        m = _GATHER.match(line)
        if not m:
            continue
        arrays = _ARRAY.findall(m.group(2))
        if m.group(3) == "all-gather-start":
            arrays = arrays[-1:]
        shape = " ".join(f"{dt}[{dims}]" for dt, dims in arrays)
        if skip_dim is not None and any(str(skip_dim) in dims.split(",") for _, dims in arrays):
            continue
        size = 0.0
        for dt, dims in arrays:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size += n * _BYTES.get(dt, 0)
        out.append((shape, size))
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
        rows = gathers(compile_step(args.target, args.devices, args.seq, name), vocab)
        total = sum(b for _, b in rows)
        base = total if name == "bf16" else base
        largest = max((b for _, b in rows), default=0) / 2 ** 20
        ratio = f", {total / base:.2f}x bf16" if base else ""
        print(f"{args.target} x{args.devices} seq {args.seq} {name}: all-gathers "
              f"{total / 1e9:.3f} GB in {len(rows)}, largest {largest:.1f} MiB{ratio} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
