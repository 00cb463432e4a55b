"""Process-level setup and host transfers: multi-host init, compile cache, fetch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.config import MeshSection


def init_distributed(mesh: MeshSection | None = None) -> None:
    """``jax.distributed.initialize()`` once per process.

    `mesh` (a config's MeshSection) may give coordinator_address, num_processes
    and process_id; unset ones are left to JAX's cluster auto-detection.
    """
    if jax.distributed.is_initialized():
        return
    kw = {}
    for k in ("coordinator_address", "num_processes", "process_id"):
        v = getattr(mesh, k, None) if mesh is not None else None
        if v is not None:
            kw[k] = v
    jax.distributed.initialize(**kw)


def use_compile_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at `path` (once per process)."""
    if not path:
        return
    current = jax.config.jax_compilation_cache_dir
    if current is None:
        Path(path).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    elif str(Path(current)) != str(Path(path)):
        print(f"[train] note: JAX compilation cache already set to {current}; "
              f"jax_cache_dir={path} not applied", file=sys.stderr)


def fetch(tree: Any) -> Any:
    """Host numpy copies of a pytree of (replicated) arrays, also on multi-host runs."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_shards[0].data)
        return np.asarray(x)
    return jax.tree.map(one, tree)
