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
import zlib
from importlib.metadata import requires, version

import pytest

from tests.accelerators.conftest import require

pytestmark = pytest.mark.gpu_extra

_CALL = re.compile(r'custom_call_target="(triton_kernel_call(?:_ffi)?)".*?'
                   r'backend_config=\{opaque = "((?:[^"\\]|\\.)*)"')


def _hlo_bytes(escaped: str) -> bytes:
    """The bytes of an HLO text string literal (C escapes, \\XX hex)."""
    out, i = bytearray(), 0
    simple = {"n": b"\n", "t": b"\t", '"': b'"', "\\": b"\\", "'": b"'"}
    while i < len(escaped):
        if escaped[i] == "\\":
            if re.fullmatch(r"[0-9A-Fa-f]{2}", escaped[i + 1:i + 3]):
                out.append(int(escaped[i + 1:i + 3], 16))
                i += 3
                continue
            out += simple.get(escaped[i + 1], escaped[i + 1].encode())
            i += 2
            continue
        out += escaped[i].encode()
        i += 1
    return bytes(out)


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
    from bench import aot
    from bench.programs import program

    fn, args = program("layer", "mxfp4_all_h16@triton", attention_impl="explicit")
    text = aot.compile_for(fn, args, require("b200")).as_text()
    calls = _CALL.findall(text)
    # 7 projections x (fprop, dgrad, wgrad), each one Triton kernel.
    assert len(calls) == 21, collections.Counter(target for target, _ in calls)
    for _, blob in calls:
        ptx = zlib.decompress(_hlo_bytes(blob))
        assert b".target sm_100a" in ptx and b".version 8.8" in ptx
        assert re.search(rb"tcgen05\.mma[^;]*kind::mxf4[^;]*block_scale", ptx), ptx[:2000]
