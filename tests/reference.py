"""Independent numpy reference for docs/NUMERICS.md (the numerics contract).

This module deliberately shares no code with ``mxjax``: its constants are written
out from the contract, and its arithmetic is float64/float32 numpy plus exact
``fractions.Fraction`` scalars, never JAX. Formats, scale rules and roundings are
the lower-case strings that ``mxjax.formats`` uses as names/enum values
('mxfp4', 'floor', 'nearest_even', ...), so the tests can pass ``rule.value``.

Why float64 is exact here: every input is an f32/bf16/f16 value (at most 24
significant bits, exponents in [-149, 127]) and every scale is a power of two
with exponent in [-127, 127] (E8M0), so ``x * 2**-s`` fits float64 exactly; the
element grids have at most 4 significant bits. Where the contract says "fp32
ops" (NVFP4 and per-tensor FP8 scales) the reference uses numpy float32
scalars, which are IEEE with gradual underflow (no flush to zero).

Main entry points (all operate on numpy arrays):
  quantize(x, fmt, axis, scale_rule, rounding, u=None, sr_prescale=False) -> RefQ
  dequantize(q, dtype) -> np.ndarray of q.shape
  fake_quantize(x, fmt, axis, ...) -> np.ndarray, same shape and dtype as x
  sylvester(h), hadamard(x, h, axis, signs)
  round_scalar_exact(...) -- a scalar exact-fraction rounding used to check
  the vectorised float64 rounding against itself.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import ml_dtypes
import numpy as np

# ----------------------------------------------------------------------------- constants


@dataclasses.dataclass(frozen=True)
class Elem:
    """Element grid, written out from the NUMERICS.md table."""

    name: str
    ebits: int
    mbits: int
    emin: int  # exponent of the smallest normal
    emax: int  # exponent of the largest power of two
    max_normal: float
    bias: int
    nan_codes: tuple[int, ...]  # magnitude codes that decode to NaN (unused by quantize)
    inf_codes: tuple[int, ...]

    @property
    def m_max(self) -> float:
        return self.max_normal / 2.0**self.emax

    @property
    def nbits(self) -> int:
        return 1 + self.ebits + self.mbits


E2M1 = Elem("e2m1", 2, 1, 0, 2, 6.0, 1, (), ())
E4M3 = Elem("e4m3", 4, 3, -6, 8, 448.0, 7, (0x7F,), ())
E5M2 = Elem("e5m2", 5, 2, -14, 15, 57344.0, 15, (0x7D, 0x7E, 0x7F), (0x7C,))


@dataclasses.dataclass(frozen=True)
class Fmt:
    name: str
    elem: Elem
    block: int | None  # None: one fp32 scale for the whole tensor
    scale: str | None  # 'e8m0', 'e4m3' or None

    @property
    def packed(self) -> bool:
        return self.elem.nbits == 4


FORMATS = {
    "mxfp4": Fmt("mxfp4", E2M1, 32, "e8m0"),
    "mxfp8_e4m3": Fmt("mxfp8_e4m3", E4M3, 32, "e8m0"),
    "mxfp8_e5m2": Fmt("mxfp8_e5m2", E5M2, 32, "e8m0"),
    "nvfp4": Fmt("nvfp4", E2M1, 16, "e4m3"),
    "fp8_e4m3": Fmt("fp8_e4m3", E4M3, None, None),
    "fp8_e5m2": Fmt("fp8_e5m2", E5M2, None, None),
}
E8M0_FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
SCALE_RULES = ("floor", "even", "ceil", "rceil")
DET_ROUNDINGS = ("nearest_even", "toward_zero", "nearest_away")
# Lower bound of the fp32 tensor scale (NVFP4 and per-tensor FP8), NUMERICS.md:
# NVFP4 2^-116; per-tensor FP8 2^(-126 + mbits - emin).
TENSOR_SCALE_FLOOR = {"nvfp4": np.float32(2.0**-116), "fp8_e4m3": np.float32(2.0**-117),
                      "fp8_e5m2": np.float32(2.0**-110)}

# ----------------------------------------------------------------------------- element grid


def round_to_grid(y, elem: Elem, rounding: str, u=None) -> np.ndarray:
    """Rounds exact values y (float64 array) onto the element grid, saturating.

    Follows NUMERICS.md "Element rounding": E = max(floor(log2|y|), emin),
    quantum 2^(E - mbits), n = |y| / quantum rounded, result sign * n * quantum
    clipped to max_normal; the sign of y (also of -0) is kept. NaN stays NaN.
    u: float32 uniforms, same shape as y, only for 'stochastic'.
    """
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    with np.errstate(divide="ignore", invalid="ignore"):
        _, k = np.frexp(a)  # a = f * 2^k with f in [0.5, 1): floor(log2 a) = k - 1
    e = np.where(a > 0, k - 1, elem.emin)
    e = np.maximum(e, elem.emin)
    quantum = np.ldexp(1.0, e - elem.mbits)
    n = a / quantum  # exact: division by a power of two, no underflow in range
    if rounding == "nearest_even":
        r = np.rint(n)  # numpy rounds half to even
    elif rounding == "nearest_away":
        r = np.floor(n + 0.5)  # exact: n has few fraction bits
    elif rounding == "toward_zero":
        r = np.floor(n)
    elif rounding == "stochastic":
        if u is None:
            raise ValueError("u: stochastic rounding needs the uniforms")
        fl = np.floor(n)
        r = fl + (np.asarray(u, np.float64) < (n - fl))
    else:
        raise ValueError(f"rounding: unknown {rounding!r}")
    mag = np.minimum(r * quantum, elem.max_normal)
    return np.copysign(mag, y)


def round_scalar_exact(y: Fraction, negative: bool, elem: Elem, rounding: str,
                       u: Fraction | None = None) -> tuple[bool, Fraction]:
    """Scalar version of round_to_grid in exact rational arithmetic.

    Returns (negative, magnitude). Used only to cross-check round_to_grid.
    """
    a = abs(y)
    if a == 0:
        e = elem.emin
    else:
        e = 0
        while Fraction(2) ** (e + 1) <= a:
            e += 1
        while Fraction(2) ** e > a:
            e -= 1
        e = max(e, elem.emin)
    quantum = Fraction(2) ** (e - elem.mbits)
    n = a / quantum
    fl = math.floor(n)
    frac = n - fl
    if rounding == "nearest_even":
        r = fl + (1 if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and fl % 2 == 1) else 0)
    elif rounding == "nearest_away":
        r = fl + (1 if frac >= Fraction(1, 2) else 0)
    elif rounding == "toward_zero":
        r = fl
    elif rounding == "stochastic":
        r = fl + (1 if u < frac else 0)
    else:
        raise ValueError(rounding)
    mag = min(r * quantum, Fraction(elem.max_normal))
    return negative, mag


def encode(v, elem: Elem) -> np.ndarray:
    """Bit pattern (uint8) of grid values v (float64, finite, on the grid)."""
    v = np.asarray(v, np.float64)
    sign = np.signbit(v).astype(np.int64)
    a = np.abs(v)
    _, k = np.frexp(a)
    e = np.where(a > 0, np.maximum(k - 1, elem.emin), elem.emin)
    n = (a / np.ldexp(1.0, e - elem.mbits)).astype(np.int64)  # integer in [0, 2^(mbits+1))
    sub = n < (1 << elem.mbits)
    field = np.where(sub, 0, e - elem.emin + 1)
    mant = np.where(sub, n, n - (1 << elem.mbits))
    code = (sign << (elem.ebits + elem.mbits)) | (field << elem.mbits) | mant
    return code.astype(np.uint8)


def decode(codes, elem: Elem) -> np.ndarray:
    """float64 values of element codes (uint8, one code per byte)."""
    c = np.asarray(codes).astype(np.int64)
    sign = (c >> (elem.ebits + elem.mbits)) & 1
    mag = c & ((1 << (elem.ebits + elem.mbits)) - 1)
    field = mag >> elem.mbits
    mant = mag & ((1 << elem.mbits) - 1)
    val = np.where(
        field == 0,
        np.ldexp(mant.astype(np.float64), elem.emin - elem.mbits),
        np.ldexp((mant + (1 << elem.mbits)).astype(np.float64), field - elem.bias - elem.mbits),
    )
    val = np.where(np.isin(mag, elem.nan_codes), np.nan, val)
    val = np.where(np.isin(mag, elem.inf_codes), np.inf, val)
    return np.where(sign == 1, -val, val)


# ----------------------------------------------------------------------------- scales


def top_scale_exponent(dtype, elem: Elem, sr_prescale: bool) -> int:
    """The largest s for which every dequantized value is finite in `dtype`.

    NUMERICS.md "Top of the range": a saturated element dequantizes to
    max_normal * 2^s (then times fp32(4/3) with the SR pre-scale, rounded to f32), and
    that, rounded to `dtype`, must not be Inf. Found by search, from 127 down.
    """
    info = ml_dtypes.finfo(dtype)
    for s in range(127, -128, -1):
        with np.errstate(over="ignore"):
            v = np.float32(np.ldexp(elem.max_normal, s))
            if sr_prescale:
                v = np.float32(v * np.float32(4.0 / 3.0))
            if np.isfinite(v) and np.isfinite(np.asarray(v).astype(dtype)) \
                    and float(v) <= float(info.max):
                return s
    raise AssertionError("unreachable")


def e8m0_exponent(amax: float, elem: Elem, rule: str, s_max: int = 127) -> int | None:
    """Scale exponent s for one block (None means the NaN scale byte 0xFF); at most `s_max`."""
    if not math.isfinite(amax):
        return None
    if amax == 0:
        return 0
    f, k = math.frexp(amax)  # amax = f 2^k, f in [0.5, 1)
    m, e = 2 * f, k - 1  # amax = m 2^e, m in [1, 2) (exact, also for subnormals)
    if rule == "floor":
        bump = 0
    elif rule == "even":
        bump = int(m >= 2 - 2.0 ** -(elem.mbits + 1))
    elif rule == "ceil":
        bump = int(m > 1)
    elif rule == "rceil":
        bump = int(m > elem.m_max)
    else:
        raise ValueError(f"scale_rule: unknown {rule!r}")
    return min(max(e - elem.emax + bump, -127), 127, s_max)


# ----------------------------------------------------------------------------- quantize


@dataclasses.dataclass
class RefQ:
    """Reference quantization in mxjax's packed layout (block axis at `axis`).

    codes: uint8 (packed two per byte, low nibble first, for 4-bit elements).
    scales: uint8 block scale bytes (None for per-tensor formats).
    tensor_scale: np.float32 scalar or None.
    values: float64 signed element values, block axis last, padded (for tests).
    nan_elems: bool, block axis last, padded: elements whose codes the contract
      leaves unspecified because their block (or tensor) is NaN.
    """

    fmt: Fmt
    shape: tuple[int, ...]
    axis: int
    codes: np.ndarray
    scales: np.ndarray | None
    tensor_scale: np.float32 | None
    values: np.ndarray
    sr_prescale: bool
    nan_elems: np.ndarray


def moved_padded_shape(shape, fmt_name: str, axis: int) -> tuple[int, ...]:
    """Shape of x after moving the block axis last and zero-padding to the block."""
    fmt = FORMATS[fmt_name]
    axis = axis % len(shape)
    rest = tuple(d for i, d in enumerate(shape) if i != axis)
    n = shape[axis]
    if fmt.block is not None:
        n = -(-n // fmt.block) * fmt.block
    return rest + (n,)


def _to_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def quantize(x, fmt: str, axis: int = -1, scale_rule: str = "floor",
             rounding: str = "nearest_even", u=None, sr_prescale: bool = False) -> RefQ:
    """Reference quantize of x (numpy f32/bf16/f16) along `axis`."""
    fmt_s = FORMATS[fmt]
    elem = fmt_s.elem
    x = np.asarray(x)
    shape = x.shape
    ax = axis % x.ndim
    xm = np.moveaxis(x, ax, -1)
    n = xm.shape[-1]
    pad = (-n) % fmt_s.block if fmt_s.block is not None else 0
    if pad:
        xm = np.concatenate([xm, np.zeros(xm.shape[:-1] + (pad,), x.dtype)], axis=-1)
    if u is not None:
        u = np.asarray(u, np.float32)
        assert u.shape == xm.shape, (u.shape, xm.shape)

    def prescale(y):  # "y is multiplied by 3/4 before rounding" (one fp32 multiply)
        if not sr_prescale:
            return y
        with np.errstate(invalid="ignore", over="ignore"):
            return (y.astype(np.float32) * np.float32(0.75)).astype(np.float64)

    scales = None
    tensor_scale = None
    if fmt_s.scale == "e8m0":
        nb = xm.shape[-1] // fmt_s.block
        xb = _to_f64(xm).reshape(xm.shape[:-1] + (nb, fmt_s.block))
        s_exp = np.zeros(xb.shape[:-1], np.int64)
        nan_blk = np.zeros(xb.shape[:-1], bool)
        s_max = top_scale_exponent(x.dtype, elem, sr_prescale)
        # Per block, in plain Python: amax and its frexp.
        for idx in np.ndindex(*xb.shape[:-1]):
            blk = xb[idx]
            if not np.all(np.isfinite(blk)):
                nan_blk[idx] = True
                continue
            s_exp[idx] = e8m0_exponent(float(np.max(np.abs(blk))), elem, scale_rule, s_max)
        y = prescale(np.ldexp(xb, -s_exp[..., None]))  # ldexp is exact
        y = np.where(nan_blk[..., None], 0.0, y)
        uu = None if u is None else u.reshape(xb.shape)
        vals = round_to_grid(y, elem, rounding, uu)
        scales = np.where(nan_blk, 0xFF, s_exp + 127).astype(np.uint8)
        nan_elems = np.broadcast_to(nan_blk[..., None], xb.shape).reshape(xm.shape)
        vals = vals.reshape(xm.shape)
        scales = np.moveaxis(scales, -1, ax)
    elif fmt_s.scale == "e4m3":  # NVFP4
        x32 = xm.astype(np.float32)
        tensor_scale = _tensor_scale(x32, np.float32(6 * 448), TENSOR_SCALE_FLOOR[fmt])
        nb = xm.shape[-1] // fmt_s.block
        xb = x32.reshape(xm.shape[:-1] + (nb, fmt_s.block))
        vals = np.zeros(xb.shape, np.float64)
        sbytes = np.zeros(xb.shape[:-1], np.uint8)
        for idx in np.ndindex(*xb.shape[:-1]):
            blk = xb[idx]
            if not np.isfinite(tensor_scale):
                sbytes[idx] = 0x7F  # E4M3 NaN
                continue
            amax_b = np.max(np.abs(blk))
            v = amax_b / (np.float32(6) * tensor_scale)  # fp32 ops, in this order
            bs_val = round_to_grid(np.float64(v), E4M3, "nearest_even")
            sbytes[idx] = encode(bs_val, E4M3)
            bs = np.float32(bs_val)
            if bs == 0:
                y = np.copysign(np.zeros(blk.shape), blk.astype(np.float64))
            else:
                denom = bs * tensor_scale  # fp32
                y = (blk / denom).astype(np.float64)  # fp32 division
            ub = None if u is None else u.reshape(xb.shape)[idx]
            vals[idx] = round_to_grid(prescale(y), E2M1, rounding, ub)
        vals = vals.reshape(xm.shape)
        nan_elems = np.broadcast_to(~np.isfinite(tensor_scale), xm.shape)
        scales = np.moveaxis(sbytes, -1, ax)
    else:  # per-tensor FP8
        x32 = xm.astype(np.float32)
        tensor_scale = _tensor_scale(x32, np.float32(elem.max_normal), TENSOR_SCALE_FLOOR[fmt])
        if np.isfinite(tensor_scale):
            y = (x32 / tensor_scale).astype(np.float64)  # fp32 division
        else:
            y = np.zeros(xm.shape)
        vals = round_to_grid(prescale(y), elem, rounding, u)
        nan_elems = np.broadcast_to(~np.isfinite(tensor_scale), xm.shape)

    codes = encode(vals, elem)
    if fmt_s.packed:
        codes = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    codes = np.moveaxis(codes, -1, ax)
    return RefQ(fmt_s, shape, ax, codes, scales, tensor_scale, vals, sr_prescale,
                np.asarray(nan_elems))


def _tensor_scale(x32: np.ndarray, divisor: np.float32, floor: np.float32) -> np.float32:
    if x32.size and not np.all(np.isfinite(x32)):
        return np.float32(np.nan)
    amax = np.max(np.abs(x32)) if x32.size else np.float32(0)
    if amax == 0:
        return np.float32(1.0)
    return np.maximum(np.float32(amax) / divisor, floor)


# ----------------------------------------------------------------------------- dequantize


def dequantize(q: RefQ, dtype=np.float32) -> np.ndarray:
    """Reference dequantize: float32 values, then cast to dtype; logical shape."""
    fmt_s = q.fmt
    codes = np.moveaxis(q.codes, q.axis, -1)
    if fmt_s.packed:
        un = np.empty(codes.shape[:-1] + (codes.shape[-1] * 2,), np.uint8)
        un[..., 0::2] = codes & 0xF
        un[..., 1::2] = codes >> 4
        codes = un
    ev = decode(codes, fmt_s.elem)  # float64 exact
    if fmt_s.scale == "e8m0":
        sb = np.moveaxis(q.scales, q.axis, -1).astype(np.int64)
        s = np.repeat(sb, fmt_s.block, axis=-1)
        out = np.where(s == 0xFF, np.nan, np.ldexp(ev, np.where(s == 0xFF, 0, s - 127)))
        # Exact in fp32 (subnormals included), except that a block amax near the fp32
        # maximum can round up to 2^128, which is Inf in fp32.
        with np.errstate(over="ignore"):
            out = out.astype(np.float32)
    elif fmt_s.scale == "e4m3":
        bs = decode(np.moveaxis(q.scales, q.axis, -1), E4M3).astype(np.float32)
        bs = np.repeat(bs, fmt_s.block, axis=-1)
        with np.errstate(invalid="ignore"):
            out = (ev.astype(np.float32) * bs) * q.tensor_scale  # fp32, left to right
    else:
        with np.errstate(invalid="ignore"):
            out = ev.astype(np.float32) * q.tensor_scale
    if q.sr_prescale:  # "the dequantized value [is multiplied] by 4/3": one fp32 multiply
        with np.errstate(invalid="ignore", over="ignore"):
            out = out * np.float32(4.0 / 3.0)
    n = q.shape[q.axis]
    out = np.moveaxis(out[..., :n], -1, q.axis)
    with np.errstate(over="ignore"):
        return out.astype(dtype)


def fake_quantize(x, fmt: str, axis: int = -1, **kw) -> np.ndarray:
    """dequantize(quantize(x)) in x's dtype."""
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        return dequantize(quantize(x, fmt, axis, **kw), np.float32).astype(x.dtype)


# ----------------------------------------------------------------------------- Hadamard


def sylvester(h: int) -> np.ndarray:
    """Unnormalised Sylvester Hadamard matrix (float64, entries ±1)."""
    mat = np.ones((1, 1))
    while mat.shape[0] < h:
        mat = np.block([[mat, mat], [mat, -mat]])
    assert mat.shape[0] == h
    return mat


def hadamard(x, h: int, axis: int = -1, signs=None) -> np.ndarray:
    """Block-diagonal (1/sqrt h) H_h (d ⊙ x_block) along `axis`, dense, float64."""
    x = np.asarray(x).astype(np.float64)
    xm = np.moveaxis(x, axis, -1)
    blocks = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // h, h))
    if signs is not None:
        blocks = blocks * np.asarray(signs, np.float64)
    out = blocks @ sylvester(h).T / math.sqrt(h)
    return np.moveaxis(out.reshape(xm.shape), -1, axis)


# ----------------------------------------------------------------------------- helpers


def float_bits(a) -> np.ndarray:
    """Unsigned-int bit pattern of a float array, with every NaN made canonical.

    NaN sign/payload is not part of the contract; -0 vs +0 is.
    """
    a = np.asarray(a)
    utype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    bits = a.view(utype).copy()
    canon = np.array(np.nan, a.dtype).view(utype)
    bits[np.isnan(a.astype(np.float64))] = canon
    return bits


def ml_dtype_of(elem: Elem):
    """The ml_dtypes type with the same grid (used only to cross-check, never to quantize)."""
    return {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
            "e2m1": ml_dtypes.float4_e2m1fn}[elem.name]
