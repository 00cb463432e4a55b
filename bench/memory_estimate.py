"""train.memory's estimate against XLA's buffer assignment of the real train step.

Prints the estimate (`train.memory.estimate`) beside ``compiled.memory_analysis()`` of the
jitted train step (state donated, as the trainer runs it), per device: arguments + outputs
- aliased + temporaries, and their ratio (`bench.costmodel.train_memory.compare`). The CPU
rows compile here; ``--target h100`` (or h200, b200) compiles deviceless for that GPU (the
CUDA PJRT plugin, ``pip install 'mxjax[aot-gpu]'``), ``--devices N`` on one host of N GPUs
with ``mesh.fsdp=N``; ``--shapes llama3_8b`` is the 8B model at seq 8192, micro-batch 16.

    PYTHONPATH=. .venv/bin/python bench/memory_estimate.py --remat
    PYTHONPATH=. .venv-aot/bin/python bench/memory_estimate.py --target h100 \\
        --shapes llama3_8b --devices 8 --remat --attention fused,explicit
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, LlamaConfig preset, overrides, seq_len, micro-batch, compute dtype)
SHAPES = [
    ("tiny-test", "tiny", {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4,
                           "n_kv_heads": 2, "ffn_dim": 128}, 64, 8, "float32"),
    ("d512-L4", "tiny", {"vocab_size": 8192, "dim": 512, "n_layers": 4, "n_heads": 8,
                         "n_kv_heads": 4, "ffn_dim": 1536}, 512, 4, "bfloat16"),
    ("d1024-L8-seq2048", "tiny", {"vocab_size": 32000, "dim": 1024, "n_layers": 8,
                                  "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 3584}, 2048, 2,
     "bfloat16"),
    ("llama3_8b", "llama3_8b", {}, 8192, 16, "bfloat16"),
]
DEFAULT_SHAPES = "tiny-test,d512-L4,d1024-L8-seq2048"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu",
                    help="cpu, or a GPU of bench/costmodel/aot.py (h100, h200, b200)")
    ap.add_argument("--devices", type=int, default=1, help="devices, all fsdp (default 1)")
    ap.add_argument("--remat", action="store_true", help="also each shape with remat")
    ap.add_argument("--attention", default="explicit",
                    help="comma-separated attention_impl values (explicit, fused)")
    ap.add_argument("--n-layers", type=int, default=None,
                    help="override the shapes' layer count (a quick, scaled compile)")
    ap.add_argument("--policy", default=None, help="a precision policy (default: none)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help=f"comma-separated shape names (default {DEFAULT_SHAPES}; also "
                    "llama3_8b)")
    args = ap.parse_args()
    from bench.costmodel import aot

    if args.target != "cpu":
        aot.use_cpu_host()
    from bench.costmodel.train_memory import compare
    from models.llama import LlamaConfig
    from mxjax import policies
    from train import memory

    policy = policies.resolve(args.policy) if args.policy else None
    print(f"target: {aot.TARGETS[args.target].description} x {args.devices} "
          f"(mesh data=1 fsdp={args.devices}); policy: {args.policy or 'none'}")
    print(f"{'shape':<18} {'remat':<6} {'attention':<9} {'estimate':>12} {'XLA':>12} "
          f"{'ratio':>6}")
    for name, preset, over, seq, micro, dtype in SHAPES:
        if name not in args.shapes.split(","):
            continue
        if args.n_layers:
            over = {**over, "n_layers": args.n_layers}
        for remat in ((False, True) if args.remat else (False,)):
            for attn in args.attention.split(","):
                mc = getattr(LlamaConfig, preset)(**over, max_seq_len=max(seq, 128),
                                                  dtype=dtype, param_dtype="float32",
                                                  remat=remat, attention_impl=attn)
                row = compare(mc, seq_len=seq, micro_batch=micro,
                              mesh_shape=(1, args.devices, 1), target_name=args.target,
                              policy=policy)
                print(f"{name:<18} {remat!s:<6} {attn:<9} {memory.gib(row.estimate):>12} "
                      f"{memory.gib(row.xla):>12} {row.ratio:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
