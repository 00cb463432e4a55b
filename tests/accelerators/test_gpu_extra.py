"""The 'gpu' extra (``pip install 'mxjax[gpu]'``): its jax and jax-triton lower the 'triton'
backend in a train step.

Run by ``make test-gpu-extra`` in its own venv (``.venv-gpu-extra``: the extra with
``train`` and ``dev``, plus XLA's CUDA PJRT plugin at the resolved jax's version for the
deviceless compile). jax-triton 0.4.1, the newest release, lowers with jax 0.11 only
(`mxjax.kernels.triton_gemm.jax_triton_mismatch`), so the extra pins jax 0.11.x; the
kernel is written in PTX 8.8 (`triton_gemm.PTX_VERSION`), which XLA's ptxas takes.
"""

from __future__ import annotations

import collections
import re
from importlib.metadata import requires, version

import pytest

from tests.accelerators.conftest import require

pytestmark = pytest.mark.gpu_extra

def test_the_extra_installed_a_pair_that_lowers():
    import jax
    import jax_triton
    from packaging.requirements import Requirement

    from mxjax.kernels import triton_gemm

    pins = [Requirement(r) for r in requires("mxjax") if 'extra == "gpu"' in r]
    assert {p.name for p in pins} >= {"jax", "jax-triton", "triton"}, pins
    for pin in pins:
        assert pin.specifier.contains(version(pin.name), prereleases=True), (pin, version(pin.name))
    assert triton_gemm.jax_triton_mismatch(jax.__version__, jax_triton.__version__) is None


def test_triton_backend_puts_every_gemm_of_the_1b_layer_on_fp4_mma_on_b200():
    from bench.costmodel import aot
    from bench.costmodel import hlo_kernels as hk
    from bench.costmodel.programs import program

    fn, args = program("layer", "mxfp4_all_h16@triton", attention_impl="explicit")
    text = aot.compile_for(fn, args, require("b200")).as_text()
    calls = [inst for inst in hk.scheduled_instructions(text)
             if inst.opcode == "custom-call" and inst.custom_call_target in hk.TRITON_CALL_TARGETS]
    # 7 projections x (fprop, dgrad, wgrad), each one Triton kernel.
    assert len(calls) == 21, collections.Counter(inst.custom_call_target for inst in calls)
    for inst in calls:
        ptx = hk.triton_call_ptx(inst)
        assert b".target sm_100a" in ptx and b".version 8.8" in ptx
        assert re.search(rb"tcgen05\.mma[^;]*kind::mxf4[^;]*block_scale", ptx), ptx[:2000]
    # The rates roofline charges each at the FP4 rate (bench/costmodel/hlo_kernels.py).
    classes = collections.Counter(cls for k in hk.kernels(text) for cls, _ in k.gemms
                                  if k.target in hk.TRITON_CALL_TARGETS)
    assert classes == {"fp4": 21}, classes
