"""capabilities(), resolve_backend() and the 'auto' choice (CPU facts plus synthetic devices)."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from mxjax import formats as F
from mxjax.kernels import (
    BACKENDS,
    Capabilities,
    auto_backend,
    backend_for_formats,
    capabilities,
    resolve_backend,
    supports,
)

ON_CPU = jax.default_backend() == "cpu"


def _caps(**kw) -> Capabilities:
    base = {"platform": "gpu", "device_kind": "NVIDIA H200", "compute_capability": (9, 0),
                "native_fp4": False, "fp8_tensor_cores": True, "pallas_mode": "triton",
                "jax_triton": True,
                "backends": (("xla", ""), ("pallas", ""), ("pallas_fp8", ""), ("triton", ""))}
    base.update(kw)
    return Capabilities(**base)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_cpu_capabilities():
    caps = capabilities()
    assert caps.platform == "cpu" and caps.compute_capability is None
    assert not caps.native_fp4 and not caps.fp8_tensor_cores
    assert caps.pallas_mode == "interpret"
    assert caps.runnable == ("xla", "pallas", "pallas_fp8")
    assert "GPU" in caps.reason("triton")
    assert resolve_backend("auto") == "xla"
    assert resolve_backend("pallas") == "pallas"  # runs, in interpret mode


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_explicit_backend_that_cannot_run_raises():
    with pytest.raises(RuntimeError, match="'triton' cannot run.*GPU"):
        resolve_backend("triton")


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda")
    with pytest.raises(ValueError, match="backend"):
        capabilities().reason("cuda")
    assert set(BACKENDS) == {"xla", "pallas", "pallas_fp8", "triton", "auto"}


def test_auto_choice_per_device():
    assert auto_backend(_caps()) == "pallas_fp8"  # H200: FP8 tensor cores, no FP4
    blackwell = _caps(device_kind="NVIDIA B200", compute_capability=(10, 0), native_fp4=True)
    assert auto_backend(blackwell) == "triton"
    no_jt = dataclasses.replace(
        blackwell, jax_triton=False,
        backends=(("xla", ""), ("pallas", ""), ("pallas_fp8", ""), ("triton", "no jax_triton")))
    assert auto_backend(no_jt) == "pallas_fp8"
    ampere = _caps(device_kind="NVIDIA A100", compute_capability=(8, 0), fp8_tensor_cores=False,
                   backends=(("xla", ""), ("pallas", ""), ("pallas_fp8", "no fp8"), ("triton", "")))
    assert auto_backend(ampere) == "pallas"
    tpu = _caps(platform="tpu", device_kind="TPU v5", compute_capability=None, pallas_mode=None)
    assert auto_backend(tpu) == "xla"
    assert resolve_backend("auto", tpu) == "xla"
    with pytest.raises(RuntimeError, match="no fp8"):
        resolve_backend("pallas_fp8", ampere)


def test_supports():
    assert supports("xla", F.NVFP4, F.MXFP8_E4M3)
    assert supports("pallas", F.MXFP4, "mxfp4")
    assert not supports("pallas_fp8", F.MXFP4, F.MXFP8_E4M3)
    assert not supports("triton", F.BF16, F.MXFP4)


def test_backend_for_formats_falls_back_only_under_auto():
    cpu = dataclasses.replace(capabilities(), platform="cpu")
    assert backend_for_formats("auto", F.NVFP4, F.MXFP4, caps=cpu) == "xla"
    assert backend_for_formats("xla", F.NVFP4, F.MXFP4, caps=cpu) == "xla"
    if cpu.can_run("pallas"):
        assert backend_for_formats("pallas", F.MXFP4, F.MXFP4, caps=cpu) == "pallas"
        with pytest.raises(ValueError, match=r"wgrad: backend 'pallas' implements MXFP4 x "
                                             r"MXFP4 only, got nvfp4 x mxfp4"):
            backend_for_formats("pallas", F.NVFP4, F.MXFP4, where="wgrad", caps=cpu)
