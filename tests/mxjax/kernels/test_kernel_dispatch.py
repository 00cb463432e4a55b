"""capabilities(), resolve_backend() and the 'auto' choice, for the chip compiled for (CPU
facts, described chips, abstract meshes, and exports lowered for other platforms)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from mxjax import formats as F
from mxjax.kernels import (
    AUTO_CHOICES,
    BACKENDS,
    AutoChoice,
    BackendUnavailableError,
    Capabilities,
    Chip,
    auto_backend,
    auto_choice,
    backend_for_formats,
    backends_per_platform,
    capabilities,
    capabilities_for,
    compute_capability_of,
    resolve_backend,
    supports,
    target_chip,
)

ON_CPU = jax.default_backend() == "cpu"


def _caps(**kw) -> Capabilities:
    base = {"platform": "gpu", "device_kind": "NVIDIA H200", "compute_capability": (9, 0),
                "native_fp4": False, "fp8_tensor_cores": True, "pallas_mode": "triton",
                "jax_triton": True,
                "backends": (("xla", ""), ("xla_fp8", ""), ("xla_fp4", ""), ("pallas", ""),
                             ("pallas_fp8", ""), ("triton", ""))}
    base.update(kw)
    return Capabilities(**base)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_cpu_capabilities():
    caps = capabilities()
    assert caps.platform == "cpu" and caps.compute_capability is None
    assert not caps.native_fp4 and not caps.fp8_tensor_cores
    assert caps.pallas_mode == "interpret"
    assert caps.runnable == ("xla", "xla_fp8", "xla_fp4", "pallas", "pallas_fp8")
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
    assert set(BACKENDS) == {"xla", "xla_fp8", "xla_fp4", "pallas", "pallas_fp8", "triton",
                             "auto"}


def test_auto_choice_per_device():
    """'auto' follows AUTO_CHOICES: 'xla_fp8' on Hopper (measured on an H200), 'xla_fp4' on
    Blackwell (estimated), the emulation wherever no route is estimated faster."""
    h200 = _caps()
    assert auto_backend(h200) == "xla_fp8"
    assert "layer_8b.h200.measured" in auto_choice(h200).evidence
    blackwell = _caps(device_kind="NVIDIA B200", compute_capability=(10, 0), native_fp4=True)
    assert auto_choice(blackwell).min_compute_capability == (10, 0)
    assert auto_backend(blackwell) == "xla_fp4"
    assert "layer_8b.b200.rates_roofline" in auto_choice(blackwell).evidence
    ampere = _caps(device_kind="NVIDIA A100", compute_capability=(8, 0), fp8_tensor_cores=False,
                   backends=(("xla", ""), ("pallas", ""), ("pallas_fp8", "no fp8"), ("triton", "")))
    assert auto_backend(ampere) == "xla"
    tpu = _caps(platform="tpu", device_kind="TPU v5", compute_capability=None, pallas_mode=None)
    assert auto_backend(tpu) == "xla"
    assert resolve_backend("auto", tpu) == "xla"
    with pytest.raises(BackendUnavailableError, match="no fp8"):
        resolve_backend("pallas_fp8", ampere)
    # Every row names its evidence; only GPU rows with FP8 units pick a route.
    assert all(row.evidence for row in AUTO_CHOICES)
    assert {row.backend for row in AUTO_CHOICES if row.platform != "gpu"
            or row.min_compute_capability is None} == {"xla"}


def test_auto_choices_evidence_supports_each_choice():
    """Every row's evidence is in the measurements file, and where it has timings the
    chosen route beats the emulation ('xla') and every other route timed beside it."""
    for row in AUTO_CHOICES:
        timed = [f for f in row.figures if f.kind in ("measured", "estimated")]
        if row.backend == "xla":
            assert all(f.kind == "rationale" for f in row.figures)
            continue
        assert timed
        for fig in timed:
            values = dict(fig.values)
            if row.backend not in values:
                continue
            others = [v for label, v in values.items()
                      if label not in ("bf16", "fp8", row.backend) and " " not in label]
            assert values[row.backend] < min(others), (row.backend, fig.summary())
        with_emulation = [f for f in timed if {"xla", row.backend} <= set(dict(f.values))]
        assert with_emulation, row


def test_auto_choice_evidence_must_be_keys():
    with pytest.raises(ValueError, match="tuple of keys"):
        AutoChoice(platform="cpu", backend="xla", evidence="3 ms faster")


def test_auto_choice_takes_a_kernel_row_only_where_it_runs():
    """A row's backend that cannot run on a chip gives 'xla', never an error."""
    row = AutoChoice(platform="gpu", min_compute_capability=(9, 0), backend="pallas_fp8",
                     evidence=("auto.cpu",))
    assert row.backend == "pallas_fp8"
    no_fp8 = _caps(backends=(("xla", ""), ("xla_fp8", "no fp8"), ("xla_fp4", "no fp4"),
                             ("pallas", ""), ("pallas_fp8", "no fp8"), ("triton", "")))
    assert auto_backend(no_fp8) == "xla"


@pytest.mark.parametrize("kind,platform,cc,fp4,fp8", [
    ("NVIDIA H200 141GB HBM3e", "gpu", (9, 0), False, True),
    ("NVIDIA B200", "gpu", (10, 0), True, True),
    ("NVIDIA GB200", "gpu", (10, 0), True, True),
    ("NVIDIA A100-SXM4-80GB", "gpu", (8, 0), False, False),
    ("TPU v5 lite", "tpu", None, False, False),
])
def test_capabilities_for_a_described_chip(kind, platform, cc, fp4, fp8):
    caps = capabilities_for(Chip(platform=platform, device_kind=kind,
                                 compute_capability=compute_capability_of(kind)))
    assert (caps.compute_capability, caps.native_fp4, caps.fp8_tensor_cores) == (cc, fp4, fp8)
    if platform == "tpu":
        assert caps.runnable == ("xla",)
        assert "Triton (GPU) or the interpreter" in caps.reason("pallas")
    else:
        assert caps.pallas_mode == "triton" and caps.can_run("pallas")
        assert caps.can_run("pallas_fp8") == fp8


def _abstract_mesh(kind: str, platform: str):
    dev = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


def test_target_chip_is_the_context_meshs_abstract_device():
    """The chip compiled for, not the tracing host: what Pallas' GPU lowering reads too."""
    host = target_chip()
    with jax.sharding.use_abstract_mesh(_abstract_mesh("NVIDIA H200", "gpu")):
        chip = target_chip()
        assert chip == Chip(platform="gpu", device_kind="NVIDIA H200", compute_capability=(9, 0))
        assert capabilities().fp8_tensor_cores
        assert target_chip("cpu") == Chip(platform="cpu", device_kind="cpu")
        assert target_chip("tpu") == Chip(platform="tpu", device_kind="")
    with jax.sharding.use_abstract_mesh(_abstract_mesh("TPU v5 lite", "tpu")):
        assert target_chip() == Chip(platform="tpu", device_kind="TPU v5 lite")
        assert resolve_backend("auto") == "xla"
        with pytest.raises(BackendUnavailableError, match="'pallas' cannot run on 'TPU v5 lite'"):
            resolve_backend("pallas")
    assert target_chip() == host


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_unknown_gpu_target_gets_no_kernel():
    """A GPU lowering with no GPU in sight: the emulation under 'auto'; kernels unavailable."""
    caps = capabilities("cuda")
    assert caps.platform == "gpu" and caps.device_kind == ""
    assert auto_backend(caps) == "xla"
    assert "no GPU target known" in caps.reason("pallas_fp8")
    per = backends_per_platform("pallas", F.MXFP4, F.MXFP4, where="fprop")
    assert per["cpu"] == ("pallas", "")
    assert per["gpu"][0] == "" and "fprop: backend 'pallas' cannot run" in per["gpu"][1]
    assert per["tpu"][0] == "" and "not tpu" in per["tpu"][1]
    assert {p: b for p, (b, _) in backends_per_platform("auto", F.MXFP4, F.MXFP4).items()} == {
        "cpu": "xla", "gpu": "xla", "tpu": "xla"}


def _policy(backend):
    from mxjax import policies

    pol = policies.get("mxfp4_all")
    return dataclasses.replace(pol, **{
        g: dataclasses.replace(getattr(pol, g), backend=backend)
        for g in ("fprop", "dgrad", "wgrad")})


def _dot(backend):
    import mxjax

    pol = _policy(backend)

    def f(a, b):
        return mxjax.dot_general(a, b, (((1,), (0,)), ((), ())), policy=pol)

    args = (jax.ShapeDtypeStruct((32, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 32), jnp.bfloat16))
    return f, args


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_explicit_backend_raises_at_lowering_for_a_chip_that_cannot_run_it():
    """Traced once for every platform; lowering for TPU raises with the reason, lowering for
    CPU (where the interpreter runs it) does not; never the emulation in its place."""
    f, args = _dot("pallas")
    exp = jax.export.export(jax.jit(f), platforms=["cpu"])(*args)
    assert "mxjax_backend_unavailable" not in exp.mlir_module()
    with pytest.raises(BackendUnavailableError,
                       match=r"fprop: backend 'pallas' cannot run on 'an unknown tpu'.*not tpu"):
        jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
    with pytest.raises(BackendUnavailableError, match="no GPU target known"):
        jax.export.export(jax.jit(f), platforms=["cuda"])(*args)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_auto_exported_for_every_platform_is_the_emulation():
    f, args = _dot("auto")
    g, _ = _dot("xla")
    for platform in ("cuda", "tpu"):
        a = jax.export.export(jax.jit(f), platforms=[platform])(*args).mlir_module()
        b = jax.export.export(jax.jit(g), platforms=[platform])(*args).mlir_module()
        assert a.count("dot_general") == b.count("dot_general") > 0
        assert "tpu_custom_call" not in a or platform == "tpu"
        assert "triton" not in a.lower()


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
