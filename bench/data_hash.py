"""Cost of the prepared-data cache key: a SHA-256 of every source's whole content.

Writes a C4-sized shard of incompressible bytes (a c4-train.*.json.gz is ~300 MB of
gzip, which is incompressible) to a temporary directory, then times, interleaved
round by round after a warm-up read:
  read       reading the file in 1 MiB chunks (the I/O floor, page cache warm)
  sha256     train.data.file_digest (streamed SHA-256, 1 MiB chunks)
  blake2b    the same loop with hashlib.blake2b, for comparison
and prints medians of wall and CPU (process) seconds and MB/s; CPU time is the
figure to trust on a shared machine.
The file is deleted at the end.

Usage: python bench/data_hash.py [--mb 300] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from train.data import HASH_CHUNK, file_digest


def _read(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(HASH_CHUNK):
            pass


def _blake2b(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=300, help="shard size in MB (10^6 bytes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the temporary shard")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "c4-train.00000-of-01024.json.gz"
        with open(path, "wb") as f:
            f.writelines(os.urandom(1_000_000) for _ in range(args.mb))
        size_mb = path.stat().st_size / 1e6
        cands = {"read": _read, "sha256": file_digest, "blake2b": _blake2b}
        _read(path)  # warm the page cache
        wall: dict[str, list[float]] = {k: [] for k in cands}
        cpu: dict[str, list[float]] = {k: [] for k in cands}
        for _ in range(args.rounds):
            for name, fn in cands.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn(path)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    print(f"shard: {size_mb:.0f} MB, {args.rounds} rounds, medians")
    for name in cands:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"  {name:8s} wall {w:7.3f} s ({size_mb / w:6.0f} MB/s)   "
              f"cpu {c:7.3f} s ({size_mb / max(c, 1e-9):6.0f} MB/s)")


if __name__ == "__main__":
    main()
