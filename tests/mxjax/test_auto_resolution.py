"""What 'auto' resolves to per GEMM on each class of chip (`PrecisionPolicy.routes`), and
which explicit backends give no speed-up on a chip (`mxjax.backends.no_speedup_reason`)."""

from __future__ import annotations

import pytest

from mxjax import policies
from mxjax.backends import capabilities_for, no_speedup_reason
from mxjax.chips import Chip
from mxjax.testing import program_text

CPU = Chip(platform="cpu", device_kind="cpu")
H200 = Chip(platform="gpu", device_kind="NVIDIA H200", compute_capability=(9, 0))
B200 = Chip(platform="gpu", device_kind="NVIDIA B200", compute_capability=(10, 0))
A100 = Chip(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0))
TPU = Chip(platform="tpu", device_kind="TPU v5 lite")
H16 = policies.get("mxfp4_all_h16")


@pytest.mark.parametrize("chip, mx, fp8", [
    (CPU, "xla", "xla"), (H200, "xla_fp8", "xla"), (B200, "xla_fp4", "xla"),
    (A100, "xla", "xla"), (TPU, "xla", "xla"),
])
def test_auto_routes_per_gemm_on_each_chip(chip, mx, fp8):
    caps = capabilities_for(chip)
    got = H16.with_backend("auto").routes(caps=caps)
    assert got == {"chip": chip.device_kind, "fprop": mx, "dgrad": mx, "wgrad": mx}
    # fp8's per-tensor formats: no FP8/FP4 route serves them; the emulation (which runs
    # f8 dots on FP8 units itself where the chip has them)
    assert policies.get("fp8").with_backend("auto").routes(caps=caps)["fprop"] == fp8
    part = policies.get("mxfp4_fprop").with_backend("auto").routes(caps=caps)
    assert part["fprop"] == mx and part["dgrad"] == part["wgrad"] == "passthrough"
    assert H16.routes(caps=caps)["fprop"] == "xla"  # the presets' own backend


def test_routes_of_a_backend_that_cannot_run_name_the_gemm():
    with pytest.raises(RuntimeError, match=r"policy\.fprop\.backend: backend 'xla_fp4' cannot "
                                           r"run on 'NVIDIA H200'"):
        H16.with_backend("xla_fp4").routes(caps=capabilities_for(H200))


@pytest.mark.parametrize("chip, backend", [(CPU, "xla_fp4"), (CPU, "xla_fp8")])
def test_a_route_that_cannot_speed_up_the_chip_says_so(chip, backend):
    why = no_speedup_reason(backend, "mxfp4", "mxfp4", caps=capabilities_for(chip),
                            where="policy.fprop")
    assert why.startswith(f"policy.fprop: backend {backend!r} gives no speed-up on 'cpu': "
                          "'auto' takes the emulation ('xla') for this GEMM there")
    assert "Use backend 'auto' (the chip's fastest exact route) or 'xla' here" in why
    assert "\n" not in why


@pytest.mark.parametrize("chip, backend", [
    (B200, "xla_fp4"), (B200, "xla_fp8"), (H200, "xla_fp8"), (CPU, "xla"), (CPU, "auto"),
])
def test_routes_faster_than_the_emulation_pass(chip, backend):
    assert no_speedup_reason(backend, "mxfp4", "mxfp4", caps=capabilities_for(chip)) == ""


def test_formats_no_route_serves_stay_on_the_emulation_and_pass():
    # 'auto' and an fp8 GEMM: the emulation either way; an explicit route that lacks the
    # formats raises as route_for does
    assert no_speedup_reason("auto", "fp8_e4m3", "fp8_e4m3", caps=capabilities_for(CPU)) == ""
    with pytest.raises(ValueError, match="MXFP4 x MXFP4 only"):
        no_speedup_reason("xla_fp8", "fp8_e4m3", "fp8_e4m3", caps=capabilities_for(CPU))


@pytest.mark.parametrize("name", ["mxfp4_all_h16", "fp8"])
def test_auto_on_a_cpu_is_the_emulation_bit_for_bit_and_the_same_program(name):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mxjax

    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (96, 48), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    key = jax.random.key(2)

    def loss(policy):
        def f(x, w):
            return jnp.sum(mxjax.dot_general(x, w, dims, policy=policy, key=key) ** 2)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    emulation, auto = (policies.get(name).with_backend(b) for b in ("xla", "auto"))
    for a, b in zip(jax.tree.leaves(loss(emulation)(x, w)), jax.tree.leaves(loss(auto)(x, w)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the same optimized program (but for source lines in its metadata): no speed difference
    texts = [program_text(loss(p).lower(x, w).compile()) for p in (emulation, auto)]
    assert texts[0] == texts[1]
