"""Process-level setup and host transfers: multi-host init, compile cache, fetch."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.config import MeshSection


class DistributedInitError(RuntimeError):
    """The processes of a ``--distributed`` run could not form a cluster."""


# JAX's own deadline is set this much later than ours: its expiry is a C++ CHECK
# failure (SIGABRT and a stack trace) that Python cannot catch, so ours must fire first.
_JAX_DEADLINE_GRACE_S = 30
INIT_TIMEOUT_EXIT = 8  # the exit code of a cluster that did not form in time (docs/RELIABILITY.md)


def init_distributed(mesh: MeshSection | None = None, *, verbose: bool = True) -> None:
    """``jax.distributed.initialize()`` once per process.

    `mesh` (a config's MeshSection) may give coordinator_address, num_processes
    and process_id; unset ones are left to JAX's cluster auto-detection. Raises
    DistributedInitError when they cannot be determined (no cluster detected).
    Waiting for the other processes is bounded by ``mesh.init_timeout_s``: when
    they have not all joined by then, the process prints what it waited for and
    exits with code 8 (``os._exit``, from a watchdog thread: JAX would abort the
    process from C++ a little later, with no message a user can act on).
    """
    if jax.distributed.is_initialized():
        return
    kw = {}
    for k in ("coordinator_address", "num_processes", "process_id"):
        v = getattr(mesh, k, None) if mesh is not None else None
        if v is not None:
            kw[k] = v
    timeout = int(getattr(mesh, "init_timeout_s", 300))
    where = kw.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS")
    who = (f"process {kw['process_id']} of {kw.get('num_processes', '?')}"
           if "process_id" in kw else "this process")
    what = (f"{who}: waiting up to {timeout}s (mesh.init_timeout_s) for every process of the "
            f"run to join the coordinator at {where or '(from the cluster environment)'}")
    if verbose:
        print(f"[train] jax.distributed.initialize: {what}", file=sys.stderr, flush=True)

    def expire() -> None:
        print(f"[train] error: --distributed: not every process joined within {timeout}s "
              f"({what}). Start the same command on every host (each with its own "
              "mesh.process_id), check mesh.coordinator_address (process 0's host and a free, "
              "reachable port) and mesh.num_processes, or raise mesh.init_timeout_s.",
              file=sys.stderr, flush=True)
        os._exit(INIT_TIMEOUT_EXIT)

    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kw,
                                   initialization_timeout=timeout + _JAX_DEADLINE_GRACE_S)
    except (ValueError, TypeError) as e:  # raised before any waiting: nothing to connect to
        raise DistributedInitError(
            f"--distributed: jax.distributed.initialize cannot tell how to reach the other "
            f"processes ({e}). No cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) was detected; "
            "set mesh.coordinator_address=host:port, mesh.num_processes=N and "
            "mesh.process_id=I (or drop --distributed for a single-host run).") from None
    finally:
        watchdog.cancel()


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
