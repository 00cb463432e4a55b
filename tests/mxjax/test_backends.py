"""The backend registry (mxjax.backends): which route runs a GEMM on the chip compiled for
(CPU facts, described chips, abstract meshes, exports lowered for other platforms), the
'auto' choice and its evidence, and the one list of backend names."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import pytest

import mxjax.routes
from mxjax import backends as B
from mxjax import formats as F
from mxjax import measurements
from mxjax.backends import (
    AUTO_CHOICES,
    BACKENDS,
    ROUTES,
    AutoChoice,
    BackendUnavailableError,
    Capabilities,
    auto_backend,
    auto_choice,
    capabilities,
    capabilities_for,
    resolve_backend,
    route_for,
    routes_per_platform,
)
from mxjax.chips import Chip, compute_capability_of, target_chip
from mxjax.recipes import GemmRecipe

ON_CPU = jax.default_backend() == "cpu"


def _caps(**kw) -> Capabilities:
    base = {"platform": "gpu", "device_kind": "NVIDIA H200", "compute_capability": (9, 0),
            "native_fp4": False, "fp8_tensor_cores": True, "jax_triton": True,
            "backends": (("xla", ""), ("xla_fp8", ""), ("xla_fp4", ""), ("xla_nvfp4", ""),
                         ("xla_mxfp8", ""), ("triton", ""))}
    base.update(kw)
    return Capabilities(**base)


def _route_modules() -> dict[str, object]:
    """Every module of mxjax.routes that declares a ROUTE, by the route's name."""
    out = {}
    for info in pkgutil.iter_modules(mxjax.routes.__path__):
        mod = importlib.import_module(f"mxjax.routes.{info.name}")
        if hasattr(mod, "ROUTE"):
            out[mod.ROUTE.name] = mod
    return out


def test_the_registry_is_every_route_module_and_nothing_else():
    """BACKENDS is the routes' names and 'auto'; each route module declares one ROUTE, named
    after its module, and the registry holds exactly those."""
    modules = _route_modules()
    assert set(modules) == set(ROUTES)
    for name, mod in modules.items():
        assert mod.__name__ == f"mxjax.routes.{name}"
        assert ROUTES[name] is mod.ROUTE
    assert BACKENDS == (*ROUTES, "auto")


def test_recipes_take_exactly_the_registrys_names():
    for name in BACKENDS:
        assert GemmRecipe(lhs=F.MXFP4, rhs=F.MXFP4, backend=name).backend == name
    for name in ("cuda", "XLA", "", None):
        with pytest.raises(ValueError,
                           match=r"GemmRecipe: backend: expected one of .*'auto'\), got"):
            GemmRecipe(lhs=F.MXFP4, rhs=F.MXFP4, backend=name)


@pytest.mark.parametrize("name", sorted(B.REMOVED_BACKENDS))
def test_a_removed_backend_names_the_supported_ones(name):
    with pytest.raises(ValueError, match=rf"backend '{name}' was removed .*CHANGELOG.*"
                                         r"'xla', 'xla_fp8', 'xla_fp4', 'xla_nvfp4', "
                                         r"'xla_mxfp8', 'triton', 'auto'"):
        GemmRecipe(lhs=F.MXFP4, rhs=F.MXFP4, backend=name)
    from mxjax import policies

    with pytest.raises(ValueError, match=f"'{name}' was removed"):
        policies.get(f"mxfp4_all@{name}")
    with pytest.raises(ValueError, match=f"'{name}' was removed"):
        policies.get("mxfp4_all").with_backend(name)


def test_every_routes_evidence_times_it():
    """Each route's evidence keys are in the measurements file, and each figure has a value
    for the route."""
    for route in ROUTES.values():
        assert route.evidence, route.name
        for key in route.evidence:
            fig = measurements.figure(key)
            assert fig.kind in ("measured", "estimated"), key
            assert route.name in dict(fig.values), (route.name, key)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_cpu_capabilities():
    caps = capabilities()
    assert caps.platform == "cpu" and caps.compute_capability is None
    assert not caps.native_fp4 and not caps.fp8_tensor_cores
    assert caps.runnable == ("xla", "xla_fp8", "xla_fp4", "xla_nvfp4", "xla_mxfp8")
    assert "GPU" in caps.reason("triton")
    assert resolve_backend("auto") == "xla"
    assert resolve_backend("xla_fp8") == "xla_fp8"  # XLA:CPU computes f8 dots exactly


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_explicit_backend_that_cannot_run_raises():
    with pytest.raises(RuntimeError, match="'triton' cannot run.*GPU"):
        resolve_backend("triton")


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="expected one of .*, got 'cuda'"):
        resolve_backend("cuda")
    with pytest.raises(ValueError, match="backend"):
        capabilities().reason("cuda")


def test_auto_choice_per_device():
    """'auto' follows AUTO_CHOICES: 'xla_fp8' on Hopper, 'xla_fp4' on Blackwell, the
    emulation wherever no route is estimated faster."""
    h200 = _caps()
    assert auto_backend(h200) == "xla_fp8"
    assert "layer_8b.h200.measured" in auto_choice(h200).evidence
    blackwell = _caps(device_kind="NVIDIA B200", compute_capability=(10, 0), native_fp4=True)
    assert auto_choice(blackwell).min_compute_capability == (10, 0)
    assert auto_backend(blackwell) == "xla_fp4"
    assert "layer_8b.b200.rates_roofline" in auto_choice(blackwell).evidence
    ampere = _caps(device_kind="NVIDIA A100", compute_capability=(8, 0), fp8_tensor_cores=False,
                   backends=(("xla", ""), ("xla_fp8", "no fp8"), ("xla_fp4", "no fp4"),
                             ("triton", "")))
    assert auto_backend(ampere) == "xla"
    tpu = _caps(platform="tpu", device_kind="TPU v5", compute_capability=None)
    assert auto_backend(tpu) == "xla"
    assert resolve_backend("auto", tpu) == "xla"
    with pytest.raises(BackendUnavailableError, match="no fp8"):
        resolve_backend("xla_fp8", ampere)
    # Only GPU rows with FP8 units pick a route.
    assert {row.backend for row in AUTO_CHOICES if row.platform != "gpu"
            or row.min_compute_capability is None} == {"xla"}


@pytest.mark.parametrize("fmt,blackwell,hopper", [
    ("mxfp4", "xla_fp4", "xla_fp8"),
    ("nvfp4", "xla_nvfp4", "xla"),
    ("mxfp8_e4m3", "xla_mxfp8", "xla"),
    ("mxfp8_e5m2", "xla_mxfp8", "xla"),
    ("fp8_e4m3", "xla", "xla"),
])
def test_auto_takes_the_first_row_that_serves_the_gemms_formats(fmt, blackwell, hopper):
    b200 = _caps(device_kind="NVIDIA B200", compute_capability=(10, 0), native_fp4=True)
    assert route_for("auto", fmt, fmt, caps=b200).name == blackwell
    assert auto_backend(b200, fmt, fmt) == blackwell
    assert route_for("auto", fmt, fmt, caps=_caps()).name == hopper
    # Without formats: the chip's first row (MXFP4's).
    assert auto_backend(b200) == "xla_fp4"
    # A served row whose route cannot run on the chip gives the emulation.
    no_nv = _caps(device_kind="NVIDIA B200", compute_capability=(10, 0), native_fp4=True,
                  backends=(("xla", ""), ("xla_fp8", ""), ("xla_fp4", ""),
                            ("xla_nvfp4", "off"), ("xla_mxfp8", "off"), ("triton", "")))
    if blackwell in ("xla_nvfp4", "xla_mxfp8"):
        assert route_for("auto", fmt, fmt, caps=no_nv).name == "xla"


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


def test_auto_choice_takes_a_route_only_where_it_runs():
    """A row's backend that cannot run on a chip gives 'xla', never an error."""
    no_fp8 = _caps(backends=(("xla", ""), ("xla_fp8", "no fp8"), ("xla_fp4", "no fp4"),
                             ("triton", "")))
    assert auto_choice(no_fp8).backend == "xla_fp8"
    assert auto_backend(no_fp8) == "xla"


@pytest.mark.parametrize("kind,platform,cc,fp4,fp8,runnable", [
    ("NVIDIA H200 141GB HBM3e", "gpu", (9, 0), False, True, {"xla", "xla_fp8"}),
    ("NVIDIA B200", "gpu", (10, 0), True, True,
     {"xla", "xla_fp8", "xla_fp4", "xla_nvfp4", "xla_mxfp8"}),
    ("NVIDIA GB200", "gpu", (10, 0), True, True,
     {"xla", "xla_fp8", "xla_fp4", "xla_nvfp4", "xla_mxfp8"}),
    ("NVIDIA A100-SXM4-80GB", "gpu", (8, 0), False, False, {"xla"}),
    ("AMD Instinct MI355X", "gpu", None, True, True, {"xla"}),
    ("TPU v5 lite", "tpu", None, False, False, {"xla"}),
])
def test_capabilities_for_a_described_chip(kind, platform, cc, fp4, fp8, runnable):
    caps = capabilities_for(Chip(platform=platform, device_kind=kind,
                                 compute_capability=compute_capability_of(kind)))
    assert (caps.compute_capability, caps.native_fp4, caps.fp8_tensor_cores) == (cc, fp4, fp8)
    assert set(caps.runnable) - {"triton"} == runnable
    if platform == "tpu":
        assert "needs a GPU target" in caps.reason("triton")
    if "AMD" in kind:
        assert "built for NVIDIA GPUs" in caps.reason("triton")


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
        with pytest.raises(BackendUnavailableError,
                           match="'xla_fp8' cannot run on 'TPU v5 lite'"):
            resolve_backend("xla_fp8")
    assert target_chip() == host


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU facts")
def test_unknown_gpu_target_gets_no_route_but_the_emulation():
    """A GPU lowering with no GPU in sight: the emulation under 'auto'; the others
    unavailable."""
    caps = capabilities("cuda")
    assert caps.platform == "gpu" and caps.device_kind == ""
    assert auto_backend(caps) == "xla"
    assert "no GPU target known" in caps.reason("xla_fp8")
    per = routes_per_platform("xla_fp8", F.MXFP4, F.MXFP4, where="fprop")
    assert per["cpu"] == (ROUTES["xla_fp8"], "")
    assert per["gpu"][0] is None and "fprop: backend 'xla_fp8' cannot run" in per["gpu"][1]
    assert per["tpu"][0] is None and "FP8 matrix units" in per["tpu"][1]
    assert {p: r.name for p, (r, _) in routes_per_platform("auto", F.MXFP4, F.MXFP4).items()} \
        == {"cpu": "xla", "gpu": "xla", "tpu": "xla"}


def _policy(backend):
    from mxjax import policies

    return policies.get("mxfp4_all").with_backend(backend)


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
    CPU (where XLA:CPU runs the f8 dot) does not; never the emulation in its place."""
    f, args = _dot("xla_fp8")
    exp = jax.export.export(jax.jit(f), platforms=["cpu"])(*args)
    assert "mxjax_backend_unavailable" not in exp.mlir_module()
    with pytest.raises(BackendUnavailableError,
                       match=r"fprop: backend 'xla_fp8' cannot run on 'an unknown tpu'.*FP8"):
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


def test_route_serves():
    assert ROUTES["xla"].serves(F.NVFP4, F.MXFP8_E4M3)
    assert ROUTES["xla_fp8"].serves(F.MXFP4, "mxfp4")
    assert not ROUTES["xla_fp4"].serves(F.MXFP4, F.MXFP8_E4M3)
    assert not ROUTES["triton"].serves(F.BF16, F.MXFP4)


def test_route_for_falls_back_only_under_auto():
    cpu = dataclasses.replace(capabilities(), platform="cpu")
    assert route_for("auto", F.NVFP4, F.MXFP4, caps=cpu) is ROUTES["xla"]
    assert route_for("xla", F.NVFP4, F.MXFP4, caps=cpu) is ROUTES["xla"]
    assert route_for("xla_fp8", F.MXFP4, F.MXFP4, caps=cpu) is ROUTES["xla_fp8"]
    with pytest.raises(ValueError, match=r"wgrad: backend 'xla_fp8' implements MXFP4 x "
                                         r"MXFP4 only, got nvfp4 x mxfp4"):
        route_for("xla_fp8", F.NVFP4, F.MXFP4, where="wgrad", caps=cpu)
