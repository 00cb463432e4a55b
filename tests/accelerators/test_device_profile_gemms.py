"""bench/device/profile.py's GEMM table, compiled for an H100 without one: each GEMM
implementation it asks XLA for (bench/device/sections/gemm_rates.py's compiler options) is
the one the optimized program holds, as `implementation_of` reads it, and the trace
parser's classes (bench/device/trace.py) name each GEMM's operand types."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench.costmodel import aot
from bench.device import estimate, trace
from bench.device.sections import gemm_rates
from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators
N = 1024


def _compiled(operands: str, setting: str, implementation: str):
    if operands == "bf16":
        fn = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16)
        args = (jax.ShapeDtypeStruct((N, N), jnp.bfloat16),) * 2
    else:
        def fn(a, b, sa, sb):
            out = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                      precision=gemm_rates.SETTINGS[setting],
                                      preferred_element_type=jnp.float32)
            return out * sa * sb

        lhs = gemm_rates.F8[operands.split("x")[0]]
        args = (jax.ShapeDtypeStruct((N, N), lhs),
                jax.ShapeDtypeStruct((N, N), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    return aot.compile_for(fn, args, require("h100"),
                           gemm_rates.IMPLEMENTATIONS[implementation]).as_text()


@pytest.mark.parametrize("implementation", sorted(gemm_rates.IMPLEMENTATIONS))
@pytest.mark.parametrize("operands, setting", [("bf16", "DEFAULT"), ("e4m3xe4m3", "DEFAULT"),
                                               ("e5m2xe4m3", "HIGHEST")])
def test_the_implementation_asked_for_is_the_one_compiled(implementation, operands, setting):
    text = _compiled(operands, setting, implementation)
    assert gemm_rates.implementation_of(text) == implementation
    gemms = {c for c in trace.hlo_classes(text).values() if c.startswith("gemm")}
    assert gemms == {f"gemm {operands}"}
    est = estimate.model_estimate_us(text, "h100")
    assert est[f"gemm {operands}"] > 0
