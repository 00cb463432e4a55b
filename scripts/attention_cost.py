"""Bytes, roofline and temp memory of one Llama 3.1-8B decoder layer's train step, per
attention form, compiled without a device (docs/PERFORMANCE.md, "Attention").

The train step is ``bench/export_shape.layer_train_step`` (loss and gradients w.r.t. the
layer's parameters and input, no policy, bf16 compute, fp32 parameters, micro-batch 1);
compiles go through ``bench/costmodel/aot.py``; bytes and the roofline (GPU targets only) are
``bench/accelerator_cost.measure``'s. Needs the ``aot-tpu``/``aot-gpu`` extras:

    .venv-aot/bin/python scripts/attention_cost.py [--targets h200,b200,v5e]
        [--impls fused,explicit] [--seq 8192]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="h200,b200,v5e")
    ap.add_argument("--impls", default="fused,explicit")
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args(argv)

    import jax

    from bench.costmodel import export_shape
    from bench.costmodel.accelerator_cost import measure
    from models.llama import LlamaConfig

    for name in args.targets.split(","):
        target = aot.TARGETS[name]
        for impl in args.impls.split(","):
            config = LlamaConfig.llama3_8b(n_layers=1, dtype="bfloat16", param_dtype="float32",
                                           attention_impl=impl)
            fn, fargs = export_shape.layer_train_step(config, None, 1, args.seq)
            t0 = time.perf_counter()
            try:
                compiled = aot.compile_for(fn, fargs, target)
            except jax.errors.JaxRuntimeError as e:  # e.g. temporaries over the HBM
                print(f"{name} {impl}: does not compile: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:300]}", flush=True)
                continue
            seconds = time.perf_counter() - t0
            temp = compiled.memory_analysis().temp_size_in_bytes
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
            line = f"{name} {impl} seq {args.seq}: temp {temp / 1e9:.3f} GB"
            if target.kind == "gpu":
                cost = measure(compiled, target, "", "layer_8b", "bf16", seconds)
                line += (f", bytes {cost.bytes / 1e9:.2f} GB, roofline "
                         f"{cost.roofline_s * 1e3:.1f} ms")
            print(f"{line}, custom calls {calls}, compile {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
