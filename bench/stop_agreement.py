"""Cost of agreeing on a stop step: `train.preemption.agree` once per training step.

Multi-process runs all-gather a 4-byte stop code at every step boundary so that a
SIGTERM delivered to one host stops every host at the same step. This starts two
real processes on 127.0.0.1 (jax.distributed, gloo CPU collectives, as
tests/train/test_two_process_resume.py does) and times, interleaved round by round
after a warm-up, in each process:
  agree      train.preemption.agree(0): the per-step cost a multi-process run pays
  fetch      a jitted scalar all-reduce over both processes' devices and its fetch to
             the host: what every training step already does once (its metrics)
and prints process 0's medians in microseconds and their ratio. On one process
`agree` returns at once (no communication; measured too, as 'agree_1p').

Usage: python bench/stop_agreement.py [--calls 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(rank: int, port: int, calls: int, rounds: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    from train.preemption import agree
    from train.process import fetch

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    local = np.ones((jax.local_device_count(),), np.float32)
    x = jax.make_array_from_process_local_data(sharding, local)
    total = jax.jit(jnp.sum, out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))

    def t_agree() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            agree(0)
        return (time.perf_counter() - t0) / calls * 1e6

    def t_fetch() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fetch(total(x))
        return (time.perf_counter() - t0) / calls * 1e6

    t_agree(), t_fetch()  # warm-up (compile, connections)
    res = {"agree": [], "fetch": []}
    for _ in range(rounds):
        res["agree"].append(t_agree())
        res["fetch"].append(t_fetch())
    if rank == 0:
        a, f = statistics.median(res["agree"]), statistics.median(res["fetch"])
        print(f"agree (2 processes): {a:8.1f} us/step")
        print(f"fetch (2 processes): {f:8.1f} us/step  (a scalar all-reduce + host fetch)")
        print(f"agree / fetch:       {a / f:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        _child(args.child, args.port, args.calls, args.rounds)
        return
    from train.preemption import agree

    agree(0)  # warm-up: the first call starts JAX's backend
    t0 = time.perf_counter()
    for _ in range(10000):
        agree(0)
    print(f"agree_1p (1 process): {(time.perf_counter() - t0) / 10000 * 1e6:7.2f} us/step")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), "--port", str(port),
                               "--calls", str(args.calls), "--rounds", str(args.rounds)],
                              env=env, cwd=ROOT) for r in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"child processes failed: {codes}")


if __name__ == "__main__":
    main()
