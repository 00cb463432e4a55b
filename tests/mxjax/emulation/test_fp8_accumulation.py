"""FP8 GEMM accumulation on Hopper tensor cores: the precision mxjax asks for per GEMM, and
docs/NUMERICS.md's bound checked against a model of the tensor core (fp8_mma_model.py).

The bound must hold for the modelled accumulation on adversarial inputs (swamping of small
products by a large running sum, cancellation, long K, E5M2's range with subnormals), and a
bound four times tighter, or the f32-accumulation bound, must fail on some of them (so the
check can fail). Fast accumulation (the forward GEMM's) has the weaker bound: the promoted
accumulation's bound fails for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from mxjax.emulation import f8_accumulation, fp8_units
from mxjax.emulation.f8_accumulation import accumulation_bound, f8_dot_precision
from mxjax.routes import xla_fp8
from tests.mxjax.emulation import fp8_mma_model as mma

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
U32 = 2.0 ** -24


def _fp8(x, dtype) -> np.ndarray:
    """x saturated and rounded to the FP8 format's values, as float64."""
    top = float(ml_dtypes.finfo(dtype).max)
    return np.asarray(np.clip(np.asarray(x, np.float32), -top, top).astype(dtype), np.float64)


def _error_ratio(a, b, *, fast, formats=("e4m3", "e4m3")) -> float:
    """max |C - A B| / (|A| |B|) of the modelled GEMM (A [M, K], B given as [N, K])."""
    c = mma.fp8_gemm(a, b, fast=fast, formats=formats)
    exact = a @ b.T
    magnitude = np.abs(a) @ np.abs(b).T
    return float(np.max(np.abs(c - exact) / magnitude))


def _swamping(k: int, every: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ``every`` elements: 32 products of 448 x 448, then products of 504 (below the
    step's grid, 2^9, once the running sum is ~6.4e6): truncated away by the tensor core."""
    a = np.full((2, k), 1.125)
    a[:, (np.arange(k) % every) < 32] = 448.0
    return _fp8(a, ml_dtypes.float8_e4m3fn), _fp8(np.full((2, k), 448.0), ml_dtypes.float8_e4m3fn)


def _worst(k: int, fast: bool):
    """The swamping that hurts each accumulation most: one large start for fast accumulation
    (one chain), a large start in every 128 for promoted accumulation (a chain per 128)."""
    return _swamping(k, k if fast else 128)


def _random(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    e4 = ml_dtypes.float8_e4m3fn
    return (_fp8(rng.standard_normal((8, k)) * 40, e4),
            _fp8(rng.standard_normal((8, k)) * np.exp(rng.uniform(-3, 3, (8, 1))) * 40, e4))


def _cancelling(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs x, -x of large products with small residues between them: the exact sum is a
    small fraction of |A| |B|."""
    rng = np.random.default_rng(seed)
    e4 = ml_dtypes.float8_e4m3fn
    big = _fp8(rng.uniform(100, 448, (4, k // 2)), e4)
    a = np.empty((4, k))
    a[:, 0::2], a[:, 1::2] = big, -big
    a[:, 5::16] = _fp8(rng.uniform(0.01, 1, (4, a[:, 5::16].shape[1])), e4)
    return a, _fp8(np.full((3, k), 448.0), e4)


def _e5m2_range(k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """dY-like E5M2 values over the whole range (subnormals to 57344) times E4M3 values
    (subnormals to 448): a dgrad's operand pair."""
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], (6, k))
    a = _fp8(sign * 2.0 ** rng.uniform(-16, 15.8, (6, k)), ml_dtypes.float8_e5m2)
    b = _fp8(rng.standard_normal((5, k)) * 2.0 ** rng.uniform(-9, 8.8, (5, k)),
             ml_dtypes.float8_e4m3fn)
    return a, b


MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}


def _subnormal_bits(a, b, formats) -> int:
    """accumulation_bound's subnormal_bits for these operands."""
    bits = 0
    for x, fmt in zip((a, b), formats):
        if np.any((x != 0) & (np.abs(x) < 2.0 ** mma.EMIN[fmt])):
            bits += MANTISSA_BITS[fmt]
    return bits


# (name, operands, formats)
CASES = [
    ("random", lambda k: _random(k, 1), ("e4m3", "e4m3")),
    ("swamping_once", lambda k: _swamping(k, k), ("e4m3", "e4m3")),
    ("swamping_every_128", lambda k: _swamping(k, 128), ("e4m3", "e4m3")),
    ("cancelling", lambda k: _cancelling(k, 2), ("e4m3", "e4m3")),
    ("e5m2_range", lambda k: _e5m2_range(k, 3), ("e5m2", "e4m3")),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("k", [96, 4096])
@pytest.mark.parametrize("name,operands,formats", CASES, ids=[c[0] for c in CASES])
def test_stated_bound_holds_for_the_modelled_tensor_core(name, operands, formats, k, fast):
    a, b = operands(k)
    bits = _subnormal_bits(a, b, formats)
    if name == "e5m2_range":
        assert bits == 5  # the case is there for the subnormals of both formats
    ratio = _error_ratio(a, b, fast=fast, formats=formats)
    assert ratio <= accumulation_bound(k, fast=fast, subnormal_bits=bits), ratio


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
def test_stated_bound_holds_at_long_k(fast):
    a, b = _worst(16384, fast)
    assert _error_ratio(a, b, fast=fast) <= accumulation_bound(16384, fast=fast)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("k", [512, 4096])
def test_a_four_times_tighter_bound_fails_on_swamping(k, fast):
    a, b = _worst(k, fast)
    assert _error_ratio(a, b, fast=fast) > accumulation_bound(k, fast=fast) / 4


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "promoted"])
def test_f32_accumulation_bound_fails_for_the_tensor_core(fast):
    k = 4096
    a, b = _worst(k, fast)
    assert _error_ratio(a, b, fast=fast) > (k + 4) * U32


def test_fast_accumulation_needs_its_own_bound():
    """The forward GEMM's fast accumulation exceeds the promoted accumulation's bound."""
    a, b = _worst(4096, fast=True)
    assert _error_ratio(a, b, fast=True) > accumulation_bound(4096, fast=False)


def test_model_truncates_below_13_fraction_bits_of_the_largest_term():
    # 128 * 64 = 2^13 sets E = 13: 1 * 0.5 lies below the grid 2^0 and is lost; 1 * 1 is kept.
    lost = mma.mma_step(np.array([128.0, 1.0]), np.array([64.0, 0.5]), np.array(0.0),
                        ("e4m3", "e4m3"))
    kept = mma.mma_step(np.array([128.0, 1.0]), np.array([64.0, 1.0]), np.array(0.0),
                        ("e4m3", "e4m3"))
    assert (lost, kept) == (8192.0, 8193.0)


def test_model_promotion_restores_what_fast_accumulation_loses():
    a, b = _swamping(256, 256)
    fast = mma.fp8_gemm(a, b, fast=True)
    promoted = mma.fp8_gemm(a, b, fast=False)
    # Fast: every 504 after the first 32 products is lost. Promoted: the first 128 lose
    # their 96, the second 128 (a chain of its own, 128 x 504 = 64512) loses nothing.
    assert np.all(fast == 32 * 448.0 * 448.0)
    assert np.all(promoted == fast + 128 * 504.0)


@pytest.mark.parametrize("lhs,rhs,gemm_name,expected", [
    (E4M3, E4M3, None, lax.Precision.DEFAULT),
    (E5M2, E4M3, None, lax.Precision.HIGHEST),
    (E4M3, E5M2, None, lax.Precision.HIGHEST),
    (E5M2, E4M3, "fprop", lax.Precision.DEFAULT),
    (E4M3, E4M3, "dgrad", lax.Precision.HIGHEST),
    (E4M3, E4M3, "wgrad", lax.Precision.HIGHEST),
])
def test_precision_per_gemm(lhs, rhs, gemm_name, expected):
    assert f8_dot_precision(gemm_name, lhs, rhs) == expected


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="gemm_name: expected one of"):
        f8_dot_precision("forward", E4M3, E4M3)
    with pytest.raises(ValueError, match="k: expected a positive"):
        accumulation_bound(0, fast=True)
    with pytest.raises(ValueError, match="subnormal_bits"):
        accumulation_bound(8, fast=True, subnormal_bits=-1)


def _f8_dot_precisions(fn, *args) -> list[str]:
    """The precision of every f8 x f8 dot_general in fn's lowering (StableHLO text)."""
    text = jax.jit(fn).lower(*args).as_text()
    return [line.split("precision = [", 1)[1].split("]", 1)[0]
            for line in text.splitlines()
            if "stablehlo.dot_general" in line and "xf8E" in line and "precision = [" in line]


@pytest.mark.parametrize("lhs,rhs,expected", [(E4M3, E4M3, "DEFAULT, DEFAULT"),
                                              (E5M2, E4M3, "HIGHEST, HIGHEST"),
                                              (E4M3, E5M2, "HIGHEST, HIGHEST")])
def test_f8_dot_asks_for_the_gemms_accumulation(lhs, rhs, expected):
    a = jnp.ones((16, 32), lhs)
    b = jnp.ones((32, 8), rhs)
    one = (jnp.float32(1),)
    assert _f8_dot_precisions(lambda a, b: fp8_units.f8_dot(
        a, b, (((1,), (0,)), ((), ())), one, one), a, b) == [expected]
    assert _f8_dot_precisions(lambda a, b: fp8_units.f8_dot(
        a, b, (((1,), (0,)), ((), ())), one, one, gemm_name="fprop"), a, b) == ["DEFAULT, DEFAULT"]


@pytest.mark.parametrize("gemm_name,expected", [(None, "HIGHEST, HIGHEST"),
                                                ("dgrad", "HIGHEST, HIGHEST"),
                                                ("fprop", "DEFAULT, DEFAULT")])
def test_xla_fp8_route_asks_for_the_gemms_accumulation(gemm_name, expected):
    from mxjax import policies

    recipe = policies.get("mxfp4_all_h16").fprop
    a = jnp.ones((16, 64), jnp.float32)
    b = jnp.ones((64, 8), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    precisions = _f8_dot_precisions(lambda a, b: xla_fp8.mx_gemm_fp8(
        a, b, dims, recipe, None, None, None, gemm_name=gemm_name), a, b)
    assert precisions == [expected]


def test_promotion_interval_matches_the_model():
    assert f8_accumulation.PROMOTION_INTERVAL == mma.PROMOTION_INTERVAL
    assert (f8_accumulation.MMA_STEP, f8_accumulation.MMA_FRACTION_BITS) == (
        mma.STEP, mma.FRACTION_BITS)
