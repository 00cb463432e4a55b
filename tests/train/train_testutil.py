"""Shared helpers for tests/train: a small, fast training config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# 2 layers, d 64: compiles in seconds on CPU.
MODEL = "{dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128, max_seq_len: 128}"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a child process: the session's compile-speed flag (tests/conftest.py),
    if set, plus ``devices`` fake CPU devices; nothing else of the parent's XLA_FLAGS."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith("--xla_backend_optimization_level=")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def fast_sets(out: Path, cache: Path, *extra: str) -> list[str]:
    """--set overrides for a tiny, quick run on a slice of the embedded corpus.

    Runs share the persistent compilation cache ``<cache>/jax``: runs of the same
    program (same model, policy, shapes and schedule) compile it once.
    """
    return [
        f"out_dir={out}",
        f"data.cache_dir={cache}",
        f"jax_cache_dir={Path(cache) / 'jax'}",
        "data.max_docs=3000",
        "data.vocab_size=512",
        "data.seq_len=64",
        f"model.overrides={MODEL}",
        "policy=passthrough",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "train.global_batch=8",
        "train.eval_sequences=16",
        "train.eval_batch=8",
        "train.progress=off",
        *extra,
    ]


def load(out: Path, cache: Path, *extra: str):
    from train import config

    return config.load(None, fast_sets(out, cache, *extra))


def run_cli(args: list[str], *, env: dict | None = None, timeout: float = 300,
            module: str = "train") -> subprocess.CompletedProcess:
    """Run ``python -m <module> ARGS`` in the repo root; returns the completed process."""
    e = dict(os.environ, XLA_FLAGS=xla_flags())
    e.update(env or {})
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout, check=False)
