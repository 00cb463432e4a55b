"""Tokens/s of the full train step of configs/tiny.yaml under precision policies.

The step is the real one from `train.loop` (forward + backward + clip + AdamW +
non-finite guard, state donated) on real batches of the embedded corpus. All
policies are compiled first, then timed interleaved in one process: each round
runs ``--steps`` steps of every policy (the order rotates per round), so load
from other processes hits all policies alike. Reported per policy: median and
best wall time per step over rounds, tokens/s (median), the process CPU time
per step (all threads; the least sensitive to other processes' load), and the
slowdown relative to no policy for each of the three. Target: ``mxfp4_all_h16``
within 1.3x of no policy (judged on the best wall time and on CPU time).

    .venv/bin/python bench/train_step.py
    .venv/bin/python bench/train_step.py --rounds 7 --steps 5 --policies none,mxfp4_all_h16

On CPU the MXFP4/FP8 policies are emulated (quantize -> dequantize -> f32 GEMM),
so the ratio measures the emulation overhead, not FP4 hardware speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from train import config as cfgmod
from train import loop

DEFAULT_POLICIES = ("none", "bf16", "fp8", "mxfp4_all", "mxfp4_all_h16")
TARGET = ("mxfp4_all_h16", 1.3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (as for python -m train)")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per policy per round")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if names[0] != "none":
        names.insert(0, "none")

    tmp = tempfile.mkdtemp(prefix="bench_train_step_")
    trainers, states = {}, {}
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}; "
          f"config {args.config}", flush=True)
    for name in names:
        cfg = cfgmod.load(args.config, [*args.set, f"policy={name}", f"out_dir={tmp}/{name}",
                                        "checkpoint.enabled=false"])
        t0 = time.time()
        tr = loop.Trainer(loop.validate(cfg, verbose=False), verbose=False)
        state = tr.init_state()
        state, m = tr.train_step(state, tr.batch(0))  # compile + first step
        jax.block_until_ready(m)
        state, m = tr.train_step(state, tr.batch(1))  # warm-up
        jax.block_until_ready(m)
        trainers[name], states[name] = tr, state
        print(f"  compiled {name:15s} in {time.time() - t0:6.1f}s", flush=True)
    cfg0 = trainers["none"].cfg
    tokens = cfg0.train.global_batch * cfg0.data.seq_len
    batches = [trainers["none"].batch(s) for s in range(2, 2 + args.steps)]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            tr, state = trainers[name], states[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for b in batches:
                state, m = tr.train_step(state, b)
            jax.block_until_ready((state, m))
            times[name].append((time.perf_counter() - t0) / len(batches))
            cpu[name].append((time.process_time() - c0) / len(batches))
            states[name] = state
    base = statistics.median(times["none"])
    base_best, base_cpu = min(times["none"]), statistics.median(cpu["none"])
    rows = []
    print(f"\ntrain step of {args.config}: {cfg0.train.global_batch} x {cfg0.data.seq_len} tokens, "
          f"{trainers['none'].n_params / 1e6:.2f}M params, {args.rounds} rounds x {args.steps} "
          f"steps, interleaved")
    print(f"{'policy':16s} {'ms/step':>8s} {'best ms':>8s} {'tokens/s':>9s} {'cpu ms':>8s} "
          f"{'x none':>7s} {'x best':>7s} {'x cpu':>6s}")
    for name in names:
        med, best = statistics.median(times[name]), min(times[name])
        c = statistics.median(cpu[name])
        row = {"policy": name, "ms_per_step": med * 1e3, "best_ms_per_step": best * 1e3,
               "tokens_per_s": tokens / med, "cpu_ms_per_step": c * 1e3,
               "slowdown_vs_none": med / base, "slowdown_best": best / base_best,
               "slowdown_cpu": c / base_cpu}
        rows.append(row)
        print(f"{name:16s} {med * 1e3:8.1f} {best * 1e3:8.1f} {tokens / med:9.0f} {c * 1e3:8.1f} "
              f"{med / base:7.2f} {best / base_best:7.2f} {c / base_cpu:6.2f}")
    tname, tmax = TARGET
    if tname in times:
        r = next(x for x in rows if x["policy"] == tname)
        ok = r["slowdown_best"] <= tmax and r["slowdown_cpu"] <= tmax
        print(f"target: {tname} within {tmax}x of no policy: {r['slowdown_best']:.2f}x (best "
              f"wall), {r['slowdown_cpu']:.2f}x (cpu) -> {'met' if ok else 'NOT met'}")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
