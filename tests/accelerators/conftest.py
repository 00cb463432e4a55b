"""Deviceless compiles for GPUs and TPUs (bench/costmodel/aot.py): shared, cached per session.

The tests marked ``accelerators`` need libtpu and the CUDA PJRT plugin (``pip install
'mxjax[aot-tpu,aot-gpu]'``, ``make test-accelerators``); without them they fail and say
so. ``jax_platforms`` is set to CPU here, before any backend starts.
"""

from __future__ import annotations

import argparse
import functools

import pytest

from bench.costmodel import aot

aot.use_cpu_host()


def require(target: str) -> aot.Target:
    """The target, or a test failure naming the package to install."""
    t = aot.TARGETS[target]
    why = aot.unavailable_reason(t)
    if why:
        pytest.fail(f"target {target!r}: {why} (make test-accelerators installs it)",
                    pytrace=False)
    return t


_ARGS = argparse.Namespace(matmul_size=4096, batch=1, seq=2048, seq_8b=8192, dump=None,
                           autotune_results=None)


@functools.cache
def _kernel_cycles():
    from bench.costmodel.accelerator_cost import KernelCycles

    return KernelCycles()


@functools.cache
def cost(target: str, program: str, policy: str, variant: str = "", attention: str = ""):
    """bench/accelerator_cost.py's row for one compile (cached for the session).

    ``attention``: the layers' LlamaConfig.attention_impl ('' = the config's default).
    """
    from bench.costmodel.accelerator_cost import compile_one

    return compile_one(require(target), variant, program, policy, _ARGS, _kernel_cycles(),
                       attention=attention)


@functools.cache
def optimized_hlo(target: str, program: str, policy: str) -> str:
    from bench.costmodel.programs import program as build

    fn, args = build(program, policy)
    return aot.compile_for(fn, args, require(target)).as_text()
