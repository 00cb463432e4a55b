"""Hopper path: MXFP4 GEMM on FP8 (E4M3) tensor cores via an exact re-encoding.

Hopper (sm_90) has FP8 tensor cores but no FP4 units. An E2M1 element times a
power of two 2^d is exactly representable in E4M3 for d in [-8, 6]
(0.5*2^-8 = 2^-9 is E4M3's smallest subnormal, 1.5*2^-8 = 3*2^-9 needs its
subnormal grid; 6*2^6 = 384 <= 448). So per 128-K chunk (4 blocks of 32) of a
row (lhs) or column (rhs):

  smax = max exponent over the chunk's *live* blocks (some nonzero code, scale
         not NaN; all-zero blocks contribute nothing and are ignored),
  each live block's elements become E4M3 bytes of  v * 2^(s - smax + 6),
  the chunk's contribution is  dot_fp8(A_chunk, B_chunk) * 2^(smax_a - 6) * 2^(smax_b - 6).

The re-encoding is exact iff every live block has s >= smax - 14 (span of
exponents <= 14 within the chunk). Chunks beyond that are flagged. An output
tile none of whose chunks is flagged (for any of its rows or columns) runs a
branch-free FP8 loop; otherwise every flagged chunk of that tile is computed
from the packed codes instead (the bf16 path of pallas_gemm), so the result
never loses accuracy. NaN blocks (scale 0xFF) are encoded as the E4M3 NaN byte 0x7F and
propagate through the dot.

`reencode_e4m3` is pure jnp (tested bit for bit on CPU). The kernel runs the
FP8 dot on GPU; with interpret=True (CPU) the FP8 dot is emulated by upcasting
the E4M3 operands to f32 (exact) at HIGHEST precision.

Accuracy on Hopper hardware: products are exact, but the FP8 tensor-core
accumulation inside one 128-K chunk is known to keep fewer than 24 bits (about
14 by DeepSeek-V3's account for H800); the chunk result is then rescaled and
added to the fp32 accumulator. See FP8_TOLERANCE_DOC.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mxjax.kernels import _common as C
from mxjax.kernels.reference import dequant_split, e8m0_to_f32

__all__ = ["CHUNK", "FP8_TOLERANCE_DOC", "MAX_SPAN", "mxfp4_matmul_fp8", "reencode_e4m3"]

CHUNK = 128  # K elements per FP8 dot / rescale
MAX_SPAN = 14  # largest exact exponent span of live blocks within a chunk
_FOLD = 6  # the chunk max block sits at 2^6 relative to the chunk reference
_E4M3_NAN = 0x7F

FP8_TOLERANCE_DOC = (
    "interpret (CPU, f32-emulated FP8 dot): the GEMM bound of pallas_gemm "
    "(2*K*2^-24*(|A|@|B|)). On Hopper FP8 tensor cores (not verified here): "
    "|C - C_ref| <= (2^-13 + 2*K*2^-24) * (|A|@|B|), allowing the reduced-precision "
    "in-chunk accumulation; bench/gpu.py measures it."
)


def reencode_e4m3(codes: jnp.ndarray, scales: jnp.ndarray, axis: int):
    """Re-encodes packed MXFP4 (2-D, blocks along `axis`) as E4M3 bytes with chunk exponents.

    Args:
      codes: uint8 E2M1 pairs packed along `axis` (length Kp/2 there).
      scales: uint8 E8M0 bytes (length Kp/32 along `axis`).
      axis: 0 or 1, the contraction axis.
    Returns:
      (e4m3 uint8 with Kc elements along `axis` (Kc = Kp rounded up to 128; the
       padding is +0), smax int32 with Kc/128 chunks along `axis` (the chunk's
       largest live block exponent; 0 if it has none), exact bool same shape).
      For an exact chunk, float(e4m3) * 2^(smax - 6) equals the dequantized value
      bit for bit (also for -0 and NaN blocks).
    """
    if axis == 0:
        e, smax, exact = reencode_e4m3(codes.T, scales.T, 1)
        return e.T, smax.T, exact.T
    r, half = codes.shape
    kp = half * 2
    kc = C.round_up(kp, CHUNK)
    codes = C.pad2(codes, r, kc // 2)
    scales = C.pad2(scales, r, kc // 32, 127)
    # Unpack in element order: element 2j in the low nibble of byte j.
    c4 = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(r, kc // 32, 32).astype(jnp.int32)
    sb = scales.astype(jnp.int32)  # (r, nb)
    s = sb - 127
    nan_blk = sb == 255
    live = jnp.any((c4 & 0x7) != 0, axis=-1) & ~nan_blk
    nch = kc // CHUNK
    s_ch = s.reshape(r, nch, 4)
    live_ch = live.reshape(r, nch, 4)
    smax = jnp.max(jnp.where(live_ch, s_ch, -1000), axis=-1)
    smax = jnp.where(jnp.any(live_ch, axis=-1), smax, 0)
    d = s_ch - smax[..., None] + _FOLD  # (r, nch, 4): fold exponent per block, <= 6 when live
    exact = jnp.all(~live_ch | (d >= _FOLD - MAX_SPAN), axis=-1)

    d = d.reshape(r, kc // 32, 1)
    mag = c4 & 0x7
    sign = c4 >> 3
    e = jnp.where(mag == 1, -1, (mag >> 1) - 1) + d  # unbiased exponent of v * 2^d
    m1 = jnp.where(mag >= 2, mag & 1, 0)  # E2M1 mantissa bit
    normal = ((e + 7) << 3) | (m1 << 2)
    sub = ((2 + m1) << jnp.clip(e + 9, 0, 8)) >> 1  # subnormal mantissa field (e in [-9, -7])
    byte = jnp.where(e >= -6, normal, jnp.where(e >= -9, sub, 0))
    byte = jnp.where(mag == 0, 0, byte) | (sign << 7)
    byte = jnp.where(nan_blk.reshape(r, kc // 32, 1), _E4M3_NAN, byte)
    return byte.reshape(r, kc).astype(jnp.uint8), smax.astype(jnp.int32), exact


def _fp8_kernel(ta_ref, tb_ref, a8_ref, ra_ref, oka_ref, b8_ref, rb_ref, okb_ref,
                ac_ref, as_ref, bc_ref, bs_ref, o_ref, *, nch: int, emulate: bool, fb_dtype):
    bm = a8_ref.shape[0]
    bn = b8_ref.shape[1]
    hp = lax.Precision.HIGHEST if emulate else None

    def fp8_chunk(c):
        a = a8_ref[:, pl.ds(c * CHUNK, CHUNK)]
        b = b8_ref[pl.ds(c * CHUNK, CHUNK), :]
        if emulate:  # exact f32 emulation of the FP8 dot (CPU)
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        d = jnp.dot(a, b, preferred_element_type=jnp.float32, precision=hp)
        sa = e8m0_to_f32(ra_ref[:, pl.ds(c, 1)] + 127)  # (bm, 1) 2^smax_a
        sb = e8m0_to_f32(rb_ref[pl.ds(c, 1), :] + 127)  # (1, bn) 2^smax_b
        return (d * jnp.float32(2.0 ** (-2 * _FOLD))) * sa * sb

    def exact_chunk(c):
        a_e, a_o = dequant_split(ac_ref[:, pl.ds(c * (CHUNK // 2), CHUNK // 2)],
                                 as_ref[:, pl.ds(c * (CHUNK // 32), CHUNK // 32)], axis=1)
        b_e, b_o = dequant_split(bc_ref[pl.ds(c * (CHUNK // 2), CHUNK // 2), :],
                                 bs_ref[pl.ds(c * (CHUNK // 32), CHUNK // 32), :], axis=0)
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=hp)
        return dot(a_e.astype(fb_dtype), b_e.astype(fb_dtype)) + dot(
            a_o.astype(fb_dtype), b_o.astype(fb_dtype))

    def mixed_step(c, acc):
        ok = (jnp.min(oka_ref[:, pl.ds(c, 1)]) > 0) & (jnp.min(okb_ref[pl.ds(c, 1), :]) > 0)
        return acc + lax.cond(ok, lambda: fp8_chunk(c), lambda: exact_chunk(c))

    zeros = jnp.zeros((bm, bn), jnp.float32)
    # Common case: every chunk of this tile is exact -> a branch-free FP8 loop.
    tile_ok = (ta_ref[0] > 0) & (tb_ref[0] > 0)
    o_ref[...] = lax.cond(
        tile_ok,
        lambda: lax.fori_loop(0, nch, lambda c, acc: acc + fp8_chunk(c), zeros),
        lambda: lax.fori_loop(0, nch, mixed_step, zeros),
    )


def mxfp4_matmul_fp8(
    a_codes: jnp.ndarray,
    a_scales: jnp.ndarray,
    b_codes: jnp.ndarray,
    b_scales: jnp.ndarray,
    *,
    m: int,
    n: int,
    block_m: int = 128,
    block_n: int = 128,
    interpret: bool | None = None,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jnp.ndarray:
    """f32[m, n] = dequant(A) @ dequant(B) through E4M3 re-encoding and FP8 dots.

    Same operand layout as `mxfp4_matmul_pallas`: a_codes u8[M, Kp/2], a_scales
    u8[M, Kp/32], b_codes u8[Kp/2, N], b_scales u8[Kp/32, N].
    """
    if interpret is None:
        interpret = C.default_interpret()
    if b_codes.shape[0] != a_codes.shape[1]:
        raise ValueError(
            f"b_codes: packed K {b_codes.shape[0]} does not match a_codes' {a_codes.shape[1]}"
        )
    bm = C.tile(a_codes.shape[0], block_m, 16)
    bn = C.tile(b_codes.shape[1], block_n, 16)
    mp, np_ = C.round_up(a_codes.shape[0], bm), C.round_up(b_codes.shape[1], bn)
    kc = C.round_up(a_codes.shape[1] * 2, CHUNK)
    a_codes = C.pad2(a_codes, mp, kc // 2)
    a_scales = C.pad2(a_scales, mp, kc // 32, 127)
    b_codes = C.pad2(b_codes, kc // 2, np_)
    b_scales = C.pad2(b_scales, kc // 32, np_, 127)
    a8, ra, oka = reencode_e4m3(a_codes, a_scales, 1)
    b8, rb, okb = reencode_e4m3(b_codes, b_scales, 0)
    a8 = lax.bitcast_convert_type(a8, jnp.float8_e4m3fn)
    b8 = lax.bitcast_convert_type(b8, jnp.float8_e4m3fn)
    nch = kc // CHUNK
    # Per output-tile flags (computed here: the Triton lowering wants power-of-two blocks).
    tile_a = jnp.all(oka.reshape(mp // bm, bm * nch), axis=1).astype(jnp.int32)
    tile_b = jnp.all(okb.reshape(nch, np_ // bn, bn), axis=(0, 2)).astype(jnp.int32)
    oka, okb = oka.astype(jnp.int32), okb.astype(jnp.int32)

    if interpret:
        params, fb_dtype = None, jnp.float32
    else:
        from jax.experimental.pallas import triton as plt

        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
        fb_dtype = jnp.bfloat16
    kernel = functools.partial(_fp8_kernel, nch=nch, emulate=interpret, fb_dtype=fb_dtype)
    row = lambda w: pl.BlockSpec((bm, w), lambda i, j: (i, 0))
    col = lambda h: pl.BlockSpec((h, bn), lambda i, j: (0, j))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (i,)), pl.BlockSpec((1,), lambda i, j: (j,)),
                  row(kc), row(nch), row(nch), col(kc), col(nch), col(nch),
                  row(kc // 2), row(kc // 32), col(kc // 2), col(kc // 32)],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=params,
        name="mxfp4_matmul_fp8",
    )(tile_a, tile_b, a8, ra, oka, b8, rb, okb, a_codes, a_scales, b_codes, b_scales)
    return out[:m, :n]
