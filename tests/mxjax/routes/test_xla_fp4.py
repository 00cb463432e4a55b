"""MXFP4 on NVFP4's block-scaled dot (mxjax/routes/xla_fp4.py), checked on this CPU machine.

* The re-encoding is bit-exact: the f4 elements times the E4M3 scales times 2^s, decoded
  by ml_dtypes / numpy, are mxjax's dequantized MXFP4 values bit for bit, and the values
  an independent numpy decode of the MXFP4 codes and E8M0 bytes gives (random data, zeros,
  all-zero blocks, NaN blocks, E8M0 2^-127 and 2^127, K not a multiple of 32, batch axes).
* ``exact`` is False exactly when the live blocks span more than the 18 binades of E4M3's
  powers of two; the blocks outside the window get NaN scales, never rounded ones.
* The GEMM (XLA:CPU runs ``jax.nn.scaled_matmul``: a dequantize and an f32 dot) is within
  docs/NUMERICS.md's bound of mxjax's CPU emulation and of the exact product; when an
  operand is not exact it is the emulation, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe
from mxjax.dimensions import Dims
from mxjax.emulation import forms
from mxjax.quantization import MXArray, quantize_with
from mxjax.recipes import GemmRecipe
from mxjax.routes import xla_fp4
from tests import reference as ref

U32 = 2.0 ** -24
MXFP4 = OperandRecipe(fmt=mxjax.MXFP4)
RECIPE = GemmRecipe(lhs=MXFP4, rhs=MXFP4)
_operand = jax.jit(xla_fp4.fp4_operand, static_argnums=1)
_reencode = jax.jit(xla_fp4.reencode)


def _unpack(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes, np.uint8)
    return np.stack([c & 0x0F, c >> 4], axis=-1).reshape(c.shape[:-1] + (c.shape[-1] * 2,))


def _mx_values(codes, scale_bytes) -> np.ndarray:
    """f32 MXFP4 values by ml_dtypes: E2M1 codes times E8M0 bytes (NaN for 0xFF)."""
    v = _unpack(codes).astype(ml_dtypes.uint4).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = np.asarray(scale_bytes, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (v * np.repeat(s, 32, axis=-1)).astype(np.float32)


def _nv_values(elements, scales, s) -> np.ndarray:
    """f32 values of the re-encoding by ml_dtypes: f4 x E4M3 (per 16) x 2^s, in f64."""
    v = np.asarray(elements)
    sc = np.asarray(scales)
    assert v.dtype == ml_dtypes.float4_e2m1fn and sc.dtype == ml_dtypes.float8_e4m3fn
    with np.errstate(over="ignore", invalid="ignore"):
        out = v.astype(np.float64) * np.repeat(sc.astype(np.float64), 16, axis=-1)
        return (out * np.ldexp(1.0, int(s))).astype(np.float32)


def _assert_same_f32(got: np.ndarray, want: np.ndarray, msg: str = ""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=msg)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32), err_msg=msg)


def _live_exponents(codes, scale_bytes):
    c = _unpack(codes).reshape(np.asarray(scale_bytes).shape + (32,))
    sb = np.asarray(scale_bytes, np.int64)
    live = (sb != 255) & np.any((c & 7) != 0, axis=-1)
    return sb[live] - 127


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    general = rng.standard_normal((2, 3, 24, 100)) * np.exp2(rng.uniform(-6, 6, (2, 3, 24, 1)))
    zeros_nan = rng.standard_normal((2, 16, 96)) * 1e3
    zeros_nan[0, 2, :] = 0.0  # an all-zero row: three all-zero blocks (scale byte 127)
    zeros_nan[1, 5, 32:64] = -0.0  # one all-zero block of negative zeros
    zeros_nan[0, 7, 40] = np.nan  # NaN blocks: scale byte 0xFF
    zeros_nan[1, 9, 3] = np.inf
    # E8M0 down to 2^-127 (byte 0), f32 subnormal inputs included.
    tiny = rng.standard_normal((4, 64)) * 2.0 ** -127
    huge = rng.standard_normal((4, 64)) * 2.0 ** 126  # the largest scales an f32 input gets
    return {"general": general.astype(np.float32), "zeros_nan": zeros_nan.astype(np.float32),
            "all_zero": np.zeros((3, 8, 40), np.float32),
            "tiny": tiny.astype(np.float32), "huge": huge.astype(np.float32),
            "k_odd": (rng.standard_normal((5, 33)) * 7).astype(np.float32)}


@pytest.mark.parametrize("case", sorted(_cases()))
def test_reencoded_operand_is_mxjaxs_mxfp4_values_bit_for_bit(case):
    x = _cases()[case]
    q = mxjax.quantize(jnp.asarray(x), mxjax.MXFP4)
    elements, scales, s, exact = _operand(jnp.asarray(x), MXFP4, None)
    k, kp = x.shape[-1], -(-x.shape[-1] // 32) * 32
    batch = int(np.prod(x.shape[:-2], dtype=np.int64)) if x.ndim > 2 else 1
    f = x.shape[-2]
    assert elements.dtype == jnp.float4_e2m1fn and scales.dtype == jnp.float8_e4m3fn
    assert elements.shape == (batch, f, kp) and scales.shape == (batch, f, kp // 16)
    assert s.dtype == jnp.int32 and s.shape == () and exact.dtype == jnp.bool_
    assert bool(exact)
    # The window's top is the largest live block: s = e_max - 8.
    e_live = _live_exponents(q.codes, q.scales)
    assert int(s) == (e_live.max() - 8 if e_live.size else 0)
    got = _nv_values(elements, scales, s).reshape(x.shape[:-1] + (kp,))
    # == mxjax's dequantized values, and == the numpy decode of mxjax's codes and bytes.
    _assert_same_f32(got[..., :k], np.asarray(mxjax.dequantize(q)), case)
    _assert_same_f32(got, _mx_values(q.codes, q.scales), case)
    # == tests/reference.py's independent quantizer (its values times its scale bytes).
    r = ref.quantize(x, "mxfp4")
    want = r.values * np.repeat(np.exp2(r.scales.astype(np.float64) - 127), 32, axis=-1)
    want = np.where(np.repeat(r.scales == 255, 32, axis=-1), np.nan, want).astype(np.float32)
    _assert_same_f32(got, want, case)
    # Padding (K to 32) holds zero codes.
    assert not np.any(np.asarray(elements).astype(np.float32)[..., k:])
    if case == "tiny":
        assert np.asarray(q.scales).min() == 0  # E8M0 2^-127 was reached
        assert np.count_nonzero(got) > 100  # and the f32-subnormal values did not flush
    if case == "huge":  # E8M0 2^125: the top an f32 input reaches (6 x 2^125 is finite)
        assert np.asarray(q.scales).max() == 252
    if case == "zeros_nan":
        sc = np.asarray(scales).view(np.uint8).reshape(2, 16, 6)
        assert sc[0, 7, 2] == 0x7F and sc[0, 7, 3] == 0x7F and sc[1, 9, 0] == 0x7F


def _bytes_and_codes(rng, shape, exponents):
    """Packed codes with a nonzero magnitude in every block, and bytes 127 + exponents."""
    c = rng.integers(0, 16, shape + (32,)).astype(np.uint8)
    c[..., 0] = rng.choice([1, 7, 9, 15], shape)  # at least one nonzero code per block
    packed = (c[..., 0::2] | (c[..., 1::2] << 4)).reshape(shape[:-1] + (shape[-1] * 16,))
    return packed, (np.asarray(exponents) + 127).astype(np.uint8)


@pytest.mark.parametrize("lo,hi", [(-127, -110), (110, 127), (-8, 9), (0, 0), (-127, 127),
                                   (-127, -109), (109, 127), (-9, 9), (3, 21)])
def test_exact_is_false_exactly_when_the_span_exceeds_18_binades(lo, hi):
    rng = np.random.default_rng((lo + 200) * 1000 + hi + 200)
    shape = (3, 7, 5)
    e = rng.integers(lo, hi + 1, shape)
    e.flat[0], e.flat[-1] = lo, hi  # the span is hi - lo + 1 binades
    codes, sb = _bytes_and_codes(rng, shape, e)
    elements, scales, s, exact = _reencode(jnp.asarray(codes), jnp.asarray(sb))
    assert bool(exact) == (hi - lo + 1 <= 18)
    assert int(s) == hi - 8
    got = _nv_values(elements, scales, s)
    want = _mx_values(codes, sb)
    inside = np.repeat(e - int(s) >= -9, 32, axis=-1)
    # Blocks in the window are exact (2^127 x 6 is Inf on both sides); the others are NaN.
    _assert_same_f32(got[inside], want[inside])
    assert np.all(np.isnan(got[~inside]))
    # mxjax's own decode of the same codes and bytes agrees where the window holds them.
    q = MXArray(jnp.asarray(codes), jnp.asarray(sb), None, codes.shape[:-1] + (32 * shape[-1],),
                codes.ndim - 1, mxjax.MXFP4)
    _assert_same_f32(got[inside], np.asarray(mxjax.dequantize(q))[inside])


def test_dead_and_nan_blocks_do_not_move_the_window():
    """Blocks of zero codes and NaN blocks are not live: their bytes (2^-127, 2^127, NaN)
    do not enter s or exact; zero blocks keep their (signed) zeros, NaN blocks stay NaN."""
    rng = np.random.default_rng(7)
    codes, sb = _bytes_and_codes(rng, (4, 6), rng.integers(-3, 4, (4, 6)))
    c = _unpack(codes).reshape(4, 6, 32)
    c[0, 1] = 0  # +0 block with byte 0 (2^-127)
    c[1, 2] = 8  # -0 block with byte 254 (2^127)
    c[2, 3] = rng.integers(0, 16, 32)  # a NaN block with arbitrary codes
    sb[0, 1], sb[1, 2], sb[2, 3] = 0, 254, 255
    flat = c.reshape(4, 6 * 32)
    codes = (flat[:, 0::2] | (flat[:, 1::2] << 4)).astype(np.uint8)
    elements, scales, s, exact = _reencode(jnp.asarray(codes), jnp.asarray(sb))
    assert bool(exact)
    e_live = _live_exponents(codes, sb)
    assert int(s) == e_live.max() - 8 and e_live.size == 21
    got = _nv_values(elements, scales, s)
    _assert_same_f32(got, _mx_values(codes, sb))
    assert np.all(np.signbit(got[1, 64:96])) and not np.any(got[1, 64:96])


def test_no_live_block_gives_shift_zero():
    codes = np.zeros((2, 32), np.uint8)
    sb = np.array([[0, 254], [255, 127]], np.uint8)
    elements, scales, s, exact = _reencode(jnp.asarray(codes), jnp.asarray(sb))
    assert int(s) == 0 and bool(exact)
    _assert_same_f32(_nv_values(elements, scales, s), _mx_values(codes, sb))


def test_reencode_and_operand_reject_bad_arguments():
    with pytest.raises(TypeError, match="codes, scale_bytes: expected uint8"):
        xla_fp4.reencode(jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 1), jnp.uint8))
    with pytest.raises(ValueError, match="codes, scale_bytes: expected"):
        xla_fp4.reencode(jnp.zeros((2, 16), jnp.uint8), jnp.zeros((2, 2), jnp.uint8))
    with pytest.raises(ValueError, match="op: expected an MXFP4"):
        xla_fp4.fp4_operand(jnp.ones((4, 32)), OperandRecipe(fmt=mxjax.NVFP4), None)
    with pytest.raises(ValueError, match="x3: expected"):
        xla_fp4.fp4_operand(jnp.ones((32,)), MXFP4, None)
    with pytest.raises(ValueError, match="recipe: expected MXFP4"):
        xla_fp4.fp4_block_scaled_dot(jnp.ones((4, 32)), jnp.ones((4, 32)),
                                             GemmRecipe(lhs="mxfp8_e4m3", rhs="mxfp4"), None, None)
    with pytest.raises(ValueError, match="a3, b3: expected"):
        xla_fp4.fp4_block_scaled_dot(jnp.ones((4, 32)), jnp.ones((4, 64)), RECIPE,
                                             None, None)


# --------------------------------------------------------------------------- the GEMM
_dot = jax.jit(xla_fp4.fp4_block_scaled_dot, static_argnums=2)
_DIMS = Dims(((3,), (3,)), ((0, 1), (0, 1)))  # [2, 3, F, K] x [2, 3, F', K]


def _gemm_operands(shift_a=0.0, shift_b=0.0, k=100):
    rng = np.random.default_rng(11)
    a = rng.standard_normal((2, 3, 40, k)) * np.exp2(rng.uniform(-4, 4, (2, 3, 40, 1)) + shift_a)
    b = rng.standard_normal((2, 3, 24, k)) * np.exp2(rng.uniform(-4, 4, (2, 3, 1, k)) + shift_b)
    return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def _emulation(a3, b3, key=None):
    return np.asarray(jax.jit(lambda a, b: forms.emulated_gemm(
        a, b, _DIMS, RECIPE, key, "fprop"))(a3, b3))


def _fast_path(a3, b3):
    """scaled_matmul of the re-encoded operands times 2^(s_a + s_b), outside any cond."""
    ae, asc, sa, _ = _operand(a3, MXFP4, None)
    be, bsc, sb, _ = _operand(b3, MXFP4, None)
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    out = np.asarray(out, np.float64) * np.ldexp(1.0, int(sa) + int(sb))
    return out.reshape(a3.shape[:-1] + (b3.shape[-2],))


def _within_bound(c, a3, b3, emul):
    aq = np.asarray(mxjax.dequantize(mxjax.quantize(a3, mxjax.MXFP4)), np.float64)
    bq = np.asarray(mxjax.dequantize(mxjax.quantize(b3, mxjax.MXFP4)), np.float64)
    k = aq.shape[-1]
    mag = np.einsum("...ik,...jk->...ij", np.abs(aq), np.abs(bq))
    exact = np.einsum("...ik,...jk->...ij", aq, bq)
    c, emul = np.asarray(c, np.float64), np.asarray(emul, np.float64)
    assert np.all(np.abs(c - exact) <= (k + 4) * U32 * mag)
    assert np.all(np.abs(c - emul) <= (2 * k + 8) * U32 * mag)
    # Tight enough to see the FP4 rounding: the unquantized product is outside the bound.
    a, b = np.asarray(a3, np.float64), np.asarray(b3, np.float64)
    plain = np.einsum("...ik,...jk->...ij", a, b)
    assert np.mean(np.abs(plain - exact) > (k + 4) * U32 * mag) > 0.5


@pytest.mark.parametrize("shift_a,shift_b,k", [
    (0.0, 0.0, 100), (60.0, -70.0, 64), pytest.param(-100.0, 0.0, 200, marks=pytest.mark.slow)])
def test_exact_operands_take_the_block_scaled_dot_within_the_bound(shift_a, shift_b, k):
    a3, b3 = _gemm_operands(shift_a, shift_b, k)
    assert bool(_operand(a3, MXFP4, None)[3]) and bool(_operand(b3, MXFP4, None)[3])
    c = np.asarray(_dot(a3, b3, RECIPE, None, None))
    assert c.shape == (2, 3, 40, 24) and np.all(np.isfinite(c))
    # The scaled_matmul branch (times 2^(s_a + s_b), exact here: the result is normal).
    np.testing.assert_array_equal(c, _fast_path(a3, b3).astype(np.float32))
    _within_bound(c, a3, b3, _emulation(a3, b3))


def test_an_operand_spanning_more_than_18_binades_takes_the_emulation():
    a3, b3 = _gemm_operands()
    a3 = a3.at[1, 2, 5, :].multiply(2.0 ** -40)  # one row 40 binades below the others
    assert not bool(_operand(a3, MXFP4, None)[3]) and bool(_operand(b3, MXFP4, None)[3])
    c = np.asarray(_dot(a3, b3, RECIPE, None, None))
    # The re-encoded operand has NaN scales there: the block-scaled branch would give NaN.
    assert np.isnan(_fast_path(a3, b3)[1, 2, 5]).all()
    emul = _emulation(a3, b3)
    np.testing.assert_array_equal(c.view(np.uint32), emul.view(np.uint32))
    _within_bound(c, a3, b3, emul)


def test_stochastic_rounding_with_the_prescale_applies_the_unscale_once_per_operand():
    op = OperandRecipe(fmt=mxjax.MXFP4, rounding="stochastic", sr_prescale=True)
    recipe = GemmRecipe(lhs=op, rhs=op)
    a3, b3 = _gemm_operands(k=96)
    ka, kb = jax.random.split(jax.random.key(3))
    c = np.asarray(_dot(a3, b3, recipe, ka, kb), np.float64)
    aq = np.asarray(mxjax.dequantize(quantize_with(a3, op, key=ka)), np.float64)
    bq = np.asarray(mxjax.dequantize(quantize_with(b3, op, key=kb)), np.float64)
    exact = np.einsum("...ik,...jk->...ij", aq, bq)
    mag = np.einsum("...ik,...jk->...ij", np.abs(aq), np.abs(bq))
    # The 4/3 unscales: one f32 multiply each on the result (the emulation rounds them into
    # each element), so a few more roundings than the deterministic bound.
    assert np.all(np.abs(c - exact) <= (96 + 8) * U32 * mag)
    # Without the unscales the result would be (3/4)^2 of this: far outside.
    assert np.mean(np.abs(c * 9 / 16 - exact) > (96 + 8) * U32 * mag) > 0.9


def _on_mma(a3, b3) -> bool:
    qa, qb = quantize_with(a3, MXFP4), quantize_with(b3, MXFP4)
    exact = [xla_fp4.fp4_operand(x, MXFP4, None)[3] for x in (a3, b3)]
    return bool(xla_fp4._on_mma(qa, qb, *exact))


def test_the_mma_branch_needs_exact_operands_without_nan_blocks():
    a3, b3 = _gemm_operands()
    assert _on_mma(a3, b3)
    assert not _on_mma(a3.at[1, 2, 5, :].multiply(2.0 ** -40), b3)  # span > 18 binades
    assert not _on_mma(a3, b3.at[0, 1, 3, 7].set(jnp.nan))  # a NaN block
    assert not _on_mma(a3.at[0, 0, 0, 99].set(jnp.inf), b3)  # an Inf: a NaN block too
    # All-zero rows are not live: they neither widen the span nor leave the branch.
    assert _on_mma(a3.at[1, 1, :, :].set(0.0), b3.at[0, 0, 2, :].set(-0.0))


def test_a_nan_block_gives_the_emulations_nans():
    a3, b3 = _gemm_operands()
    b3 = b3.at[0, 1, 3, 7].set(jnp.nan)
    c = np.asarray(_dot(a3, b3, RECIPE, None, None))
    emul = _emulation(a3, b3)
    assert np.isnan(c[0, 1, :, 3]).all() and np.isnan(c).sum() == 40
    _assert_same_f32(c, emul)


def full_window_operands(k: int, rows: int = 36, cols: int = 24, seed: int = 0):
    """[1, rows, k] and [1, cols, k] f32 whose MXFP4 quantization is exact and whose lhs
    fills the whole window: row r is E2M1 grid values times 2^-(r % 18), each block's
    largest magnitude 4 or 6 (so its E8M0 exponent is -(r % 18) under every scale rule):
    s = -8 and E4M3 scales 2^-9 .. 2^8, its three subnormals included."""
    rng = np.random.default_rng(seed)
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

    def values(n, exps):
        c = rng.choice(grid, (n, k)) * rng.choice([-1.0, 1.0], (n, k))
        c[:, ::32] = rng.choice([4.0, 6.0, -4.0, -6.0], (n, -(-k // 32)))
        return (c * np.exp2(exps)[:, None]).astype(np.float32)[None]

    a = values(rows, -(np.arange(rows) % 18))
    b = values(cols, rng.integers(-3, 4, cols))
    return jnp.asarray(a), jnp.asarray(b)


def test_the_full_window_is_exact_and_on_the_mma_branch():
    a3, b3 = full_window_operands(96)
    _, scales, s, exact = _operand(a3, MXFP4, None)
    assert bool(exact) and int(s) == -8
    used = set(np.asarray(scales).view(np.uint8).ravel().tolist())
    assert {0x01, 0x02, 0x04} <= used and max(used) == 0x78  # 2^-9, 2^-8, 2^-7 .. 2^8
    np.testing.assert_array_equal(np.asarray(mxjax.dequantize(quantize_with(a3, MXFP4))), a3)
    assert _on_mma(a3, b3)


# --- the 'xla_fp4' backend: this route as a GEMM recipe's backend -------------------------


# (The policy-level fwd+bwd test of 'xla_fp4' is test_accelerator_mx_fp8's, beside
# 'xla_fp8''s.)


@pytest.mark.parametrize("kind,cc,ok", [
    ("NVIDIA B200", (10, 0), True), ("NVIDIA GB300", (10, 3), True),
    ("NVIDIA H200", (9, 0), False), ("", None, False), ("AMD Instinct MI355X", None, False)])
def test_capabilities_of_xla_fp4(kind, cc, ok):
    from mxjax.backends import capabilities_for
    from mxjax.chips import Chip

    caps = capabilities_for(Chip(platform="gpu", device_kind=kind, compute_capability=cc))
    assert caps.can_run("xla_fp4") == ok, caps.reason("xla_fp4")
    assert capabilities_for(Chip(platform="cpu", device_kind="cpu")).can_run("xla_fp4")
    tpu = capabilities_for(Chip(platform="tpu", device_kind="TPU v5 lite"))
    assert "Blackwell" in tpu.reason("xla_fp4")


def test_mx_dot_refuses_xla_fp4_with_a_reason():
    import mxjax
    from mxjax.backends import mx_dot

    q = mxjax.quantize(jnp.ones((8, 64)), mxjax.MXFP4, axis=1)
    with pytest.raises(ValueError, match="xla_fp4.*GEMM recipe"):
        mx_dot(q, q, backend="xla_fp4")


def _loop_dots(jaxpr, in_loop=False, in_branch=None):
    """(in a loop, cond branch index or None, result shape) of every dot_general."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append((in_loop, in_branch, e.outvars[0].aval.shape))
        for name, v in e.params.items():
            subs = v if isinstance(v, (tuple, list)) else (v,)
            for i, sub in enumerate(subs):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    branch = i if (e.primitive.name == "cond" and name == "branches") \
                        else in_branch
                    out += _loop_dots(inner, in_loop or e.primitive.name in ("while", "scan"),
                                      branch)
    return out


def test_the_emulation_fallback_holds_one_piece_of_the_result_at_a_time():
    """The cond's emulation branch (operands outside the FP4 window) takes both operands in
    `FALLBACK_ROW_CHUNKS` pieces (with a packed rhs, q dequantized and contracted in pieces
    of its rows): on a GPU whole operand values and the f32 result, in the conditional's
    other branch, would otherwise set the layer's peak memory."""
    from mxjax.routes import xla_fp8

    n = xla_fp8.FALLBACK_ROW_CHUNKS
    recipe = mxjax.policies.get("mxfp4_all_h16").fprop
    signs = mxjax.fixed_signs(0, 16)
    a = jnp.ones((8, 64, 128), jnp.bfloat16)
    b = jnp.ones((128, 96), jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    jaxpr = jax.make_jaxpr(lambda a, b: xla_fp4.mx_gemm_fp4(
        a, b, dims, recipe, None, None, signs, out_dtype=jnp.bfloat16))(a, b)
    dots = _loop_dots(jaxpr.jaxpr)
    # the emulation: the lhs's rows in pieces, the rhs's columns in pieces of those
    assert (True, 0, (8, 64 // n, 96 // n)) in dots
    assert not [d for d in dots if d[1] == 0 and not d[0]]  # and no whole dot there
    q = quantize_with(jnp.ones((96, 128)), recipe.rhs, -1)
    jaxpr = jax.make_jaxpr(lambda a, q: xla_fp4.mx_gemm_fp4_packed_rhs(
        a, q, b.shape, dims, recipe, None, signs, out_dtype=jnp.bfloat16))(a, q)
    dots = _loop_dots(jaxpr.jaxpr)
    assert (True, 0, (8, 64 // n, 96 // n)) in dots  # and q's rows in pieces
    assert not [d for d in dots if d[1] == 0 and not d[0]]
