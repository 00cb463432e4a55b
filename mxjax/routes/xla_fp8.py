"""MXFP4 GEMMs on FP8 matrix units: the 'xla_fp8' backend (Hopper's fastest MXFP4 route).

Hopper (H100/H200) has FP8 tensor cores but no FP4 ones. An MXFP4 value is an E2M1
element times its block's power of two, ``v = q * 2^s`` (``|q| <= 6``, two significant
bits). Shifted by one power of two per tensor, ``v * 2^-t``, it is exactly an FP8
value whenever its block's scale is within the FP8 format's window of the tensor's
largest block scale ``s_max``:

==========  ==========================  ========================================
carrier     shift ``t``                 exact for blocks with
==========  ==========================  ========================================
E4M3        ``s_max - 6`` (6 * 2^6 <= 448)   ``s >= s_max - 14`` (E4M3 subnormals)
E5M2        ``s_max - 13`` (6 * 2^13 <= 57344) ``s >= s_max - 28``
==========  ==========================  ========================================

so the GEMM of the dequantized operands is ``dot(A8, B8) * 2^(t_a + t_b)``: one FP8
GEMM whose products are exact, with the two tensor factors applied to its f32 result
(XLA folds them into the GEMM as it does the ``fp8`` preset's scales). The operands
are the emulation's in-place operands (`mxjax.emulation.in_place.mx_operand_values`: each
operand quantized where it is, in two fusible passes, Hadamard included), cast to
FP8 instead of bf16 in the second pass: half the bytes the GEMM reads, twice the
matrix rate.

**No silent loss.** Whether every live block (amax > 0, finite) of both operands is
inside its window is known after the first pass (from the block amaxes). If one is
not, the GEMM's result is the emulation's (``lax.cond``; the branch not taken costs
nothing), so the values never depend on the window: they are the emulation's up to
summation order and the FP8 MMA's accumulation (docs/NUMERICS.md states the bound).
A block of NaN or Inf gives NaN where the emulation gives NaN or Inf (E4M3 has no
Inf).

cuBLAS takes E4M3 x E4M3 and the mixed pairs, not E5M2 x E5M2, so the wide window
(E5M2) goes to the lhs (X in fprop, dY in dgrad and wgrad: `mxjax.policies`' operand
order), the narrow one (E4M3) to the rhs (W, and X in wgrad).

`mxjax.routes.xla_fp4` (the 'xla_fp4' backend) carries the same in-place operands in
NVFP4 instead (E2M1 elements, E4M3 scales per 16) for XLA's block-scaled dot.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax.chips import Chip
from mxjax.emulation import f8_accumulation, in_place
from mxjax.formats import E2M1, E4M3, E5M2, ElementFormat
from mxjax.quantization import MXArray, dequantize
from mxjax.routes.spec import (
    NO_GPU_TARGET,
    Route,
    check_canonical_operand,
    in_place_route_gemm,
    in_place_route_packed_rhs_gemm,
)
from mxjax.scaling import SR_UNSCALE

__all__ = [
    "CARRIERS",
    "CARRIER_PRODUCT_EXPONENTS",
    "FALLBACK_ROW_CHUNKS",
    "LHS_CARRIER",
    "RHS_CARRIER",
    "ROUTE",
    "Carrier",
    "carrier_window",
    "encode_exact",
    "in_place_views",
    "mx_dot_fp8",
    "mx_gemm_fp8",
    "mx_gemm_fp8_packed_rhs",
    "narrow_result",
    "narrow_result_exact",
    "packed_window",
    "scaled_result",
    "takes_fp8_route",
    "window_of_exponents",
]


class Carrier:
    """An FP8 format that carries E2M1 x 2^s values exactly: its dtype and window."""

    def __init__(self, fmt: ElementFormat, dtype):
        self.fmt, self.dtype = fmt, jnp.dtype(dtype)
        # Largest k with max|q| * 2^k <= the carrier's max (the top block's shift).
        self.top = math.floor(math.log2(fmt.max_normal / E2M1.max_normal))
        # Smallest (s - t) whose element grid (min_subnormal(q) * 2^(s - t)) is on the
        # carrier's grid.
        self.lowest = round(math.log2(fmt.min_subnormal / E2M1.min_subnormal))

    @property
    def span(self) -> int:
        """Blocks with scale exponent >= s_max - span are carried exactly."""
        return self.top - self.lowest

    def __repr__(self):
        return f"Carrier({self.fmt.name}, top={self.top}, span={self.span})"


CARRIERS = {"e4m3": Carrier(E4M3, jnp.float8_e4m3fn), "e5m2": Carrier(E5M2, jnp.float8_e5m2)}
LHS_CARRIER = CARRIERS["e5m2"]
RHS_CARRIER = CARRIERS["e4m3"]

# The emulation fallbacks of the MXFP4 routes (this one, `mxjax.routes.xla_fp4`) take their
# larger operand in this many pieces (`in_place.mx_gemm`'s ``row_chunks``): whole, its bf16
# values (224 MiB for an 8B MLP activation at 8192 tokens) and the f32 result (448 MiB) live
# in the conditional's other branch and set the layer's peak temporary memory on a B200.
FALLBACK_ROW_CHUNKS = 8
MIN_EXP, MAX_EXP = -126, 127  # _bits.pow2's range


def takes_fp8_route(recipe) -> bool:
    """Whether the 'xla_fp8' route implements the recipe: MXFP4 (E2M1 elements, E8M0
    scales per 32) on both operands."""
    return all(op.fmt.scale == "e8m0" and op.fmt.block_size == in_place.MX_BLOCK
               and op.fmt.element == E2M1 and not op.fmt.is_per_tensor
               for op in (recipe.lhs, recipe.rhs))


def carrier_window(amax_bits: jax.Array, op, carrier: Carrier) -> tuple[jax.Array, jax.Array]:
    """(shift t, exact) of one operand from its blocks' amax bits.

    Args:
      amax_bits: uint32 abs bits of every block's amax (any layout).
      op: the operand's OperandRecipe (MXFP4).
      carrier: the FP8 format the values are cast to.
    Returns:
      ``t``: int32 scalar, the tensor's shift (values are carried as ``v * 2^-t``), in
      [-127, 126]; ``exact``: bool scalar, every live finite block is in the window.
    """
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    return window_of_exponents(s, (amax_bits != 0) & ~nonfinite, carrier)


def window_of_exponents(s: jax.Array, live: jax.Array, carrier: Carrier):
    """`carrier_window` from the blocks' scale exponents ``s`` (int32) and which blocks
    are ``live`` (finite scale and some nonzero value)."""
    big = jnp.iinfo(jnp.int32).max
    s_max = jnp.max(jnp.where(live, s, -big))
    s_min = jnp.min(jnp.where(live, s, big))
    t = jnp.clip(s_max - carrier.top, -MAX_EXP, -MIN_EXP).astype(jnp.int32)
    # No live block: all values are zero or NaN, carried exactly whatever t.
    exact = (s_min - t >= carrier.lowest) | ~jnp.any(live)
    return t, exact


def encode_exact(v: jax.Array, t: jax.Array, carrier: Carrier) -> jax.Array:
    """``v * 2^-t`` cast to the carrier's dtype (exact where `carrier_window` says so).

    ``v``: f32 MX values (NaN for non-finite blocks); ``t`` an int32 scalar in
    [-127, 126]. The multiply is exact (a power of two, results in the carrier's range).
    """
    return (v * _bits.pow2(-t)).astype(carrier.dtype)


def in_place_views(a, b, dims, recipe, operand_dtypes, backend: str, *,
                   takes=takes_fp8_route, formats: str = "MXFP4 x MXFP4"):
    """(a, b cast, their contraction views, the Hadamard size or None) for an in-place
    route ('xla_fp8', 'xla_fp4'; 'xla_mxfp8' with its own ``takes`` and ``formats``);
    raises unless ``takes(recipe)``."""
    if not takes(recipe):
        raise ValueError(f"recipe: the {backend!r} backend takes {formats}, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    a, b = in_place.cast_operands(a, b, operand_dtypes)
    (ca, cb), (ba, bb) = dims
    va, vb = in_place.contraction_view(a, ba, ca), in_place.contraction_view(b, bb, cb)
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    return a, b, va, vb, h


def scaled_result(out: jax.Array, shift: jax.Array, recipe, out_dtype) -> jax.Array:
    """A carriers' GEMM result times 2^shift and each operand's SR unscale, cast."""
    out = _apply_pow2(out, shift)
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out if out_dtype is None else out.astype(out_dtype)


def _apply_pow2(out: jax.Array, e: jax.Array) -> jax.Array:
    """out * 2^e for an int32 scalar e in [-254, 252], as two normal-range multiplies."""
    half = e // 2
    return (out * _bits.pow2(half)) * _bits.pow2(e - half)


def mx_gemm_fp8(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
                operand_dtypes=None, out_dtype=None, gemm_name: str | None = None) -> jax.Array:
    """``dot_general(a, b, dims)`` under an MXFP4 recipe on FP8 GEMMs: f32, lax's layout.

    Same operands, keys and rotation as `mxjax.emulation.in_place.mx_gemm` (form 'gpu'), whose
    result it returns when an operand's blocks span more than its carrier's window.

    Args:
      a, b: the GEMM's operands (any float dtype), ``dims`` lax dimension numbers.
      recipe: a GemmRecipe that `takes_fp8_route`.
      k_lhs, k_rhs: the rounding keys (stochastic rounding) or None.
      signs: the Hadamard's ±1 vector or None.
      operand_dtypes: None or a pair of dtypes (or None) a and b are cast to first.
      out_dtype: the f32 result is cast to this in both branches (None: f32), so that
        XLA fuses the cast and the factors into the GEMM instead of writing f32 out of
        the conditional.
      gemm_name: 'fprop' asks for fast accumulation (precision DEFAULT), 'dgrad' and
        'wgrad' for promoted accumulation (HIGHEST), as Transformer Engine does
        (`mxjax.routes.f8_accumulation`); None: the carriers decide, and an E5M2 lhs
        always asks for promoted accumulation.
    Returns:
      ``[batch..., lhs free..., rhs free...]`` (f32 or out_dtype), times each operand's
      SR unscale.
    """
    a, b, va, vb, h = in_place_views(a, b, dims, recipe, operand_dtypes, "xla_fp8")
    k = va.x.shape[va.axis]
    kw = {"k_out": k if h is None else -(-k // h) * h, "hadamard_size": h, "signs": signs}
    ops = ((va, recipe.lhs, k_lhs, LHS_CARRIER), (vb, recipe.rhs, k_rhs, RHS_CARRIER))
    encoded = []
    for view, op, key, carrier in ops:
        def finish(v, amax_bits, op=op, carrier=carrier):
            t, exact = carrier_window(amax_bits, op, carrier)
            return encode_exact(v, t, carrier), (t, exact)

        encoded.append(in_place.mx_operand_values(view, op, key=key, finish=finish, **kw))
    (qa, (ta, exact_a)), (qb, (tb, exact_b)) = encoded
    contract = (((va.axis,), (vb.axis,)), (va.batch, vb.batch))

    def emulated(a, b):
        return in_place.mx_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs, form="gpu",
                                out_dtype=out_dtype, row_chunks=FALLBACK_ROW_CHUNKS)

    return _carried_gemm((qa, ta, exact_a), (qb, tb, exact_b), contract, recipe, out_dtype,
                         kw["k_out"], gemm_name, emulated, (a, b))


def _carried_gemm(lhs, rhs, contract, recipe, out_dtype, k_out: int, gemm_name, emulated,
                  operands) -> jax.Array:
    """The FP8 GEMM of two carried operands ``(values, t, exact)`` times ``2^(t_a + t_b)``
    (and the SR unscales), or ``emulated(*operands)`` where either is not exact
    (``lax.cond``)."""
    (qa, ta, exact_a), (qb, tb, exact_b) = lhs, rhs
    narrow = narrow_result(recipe, out_dtype)
    exact = exact_a & exact_b
    if narrow:
        exact = exact & narrow_result_exact(ta + tb, k_out, CARRIER_PRODUCT_EXPONENTS)

    precision = f8_accumulation.f8_dot_precision(gemm_name, qa.dtype, qb.dtype)

    def fp8(*_):
        if narrow:  # the GEMM writes bf16 itself: 2 bytes per result, not 4 + a pass
            out = lax.dot_general(qa, qb, contract, precision=precision,
                                  preferred_element_type=jnp.bfloat16)
            return scaled_result(out.astype(jnp.float32), ta + tb, recipe, out_dtype)
        out = lax.dot_general(qa, qb, contract, precision=precision,
                              preferred_element_type=jnp.float32)
        return scaled_result(out, ta + tb, recipe, out_dtype)

    return lax.cond(exact, fp8, emulated, *operands)


def packed_window(q: MXArray, carrier: Carrier) -> tuple[jax.Array, jax.Array]:
    """`carrier_window` of an operand already quantized (a canonical MXFP4 MXArray, e.g. a
    packed residual), from its codes and scale bytes: its live blocks are those whose
    input was not all zeros (a nonzero code, or a scale other than an all-zero block's 1:
    inputs so small every code rounds to zero have their exponent clamped at -127, and
    the in-place form counts them live too), NaN blocks (0xFF) excluded."""
    scale = q.scales.astype(jnp.int32)
    codes = q.codes.reshape(q.scales.shape + (-1,))  # each block's 16 bytes
    nonzero = jnp.any((codes & 0x77) != 0, axis=-1)  # a nibble's magnitude bits
    live = (scale != 255) & ((scale != 127) | nonzero)
    return window_of_exponents(scale - 127, live, carrier)


def mx_gemm_fp8_packed_rhs(a: jax.Array, q: MXArray, b_shape, dims, recipe, k_lhs, signs, *,
                           operand_dtype=None, out_dtype=None,
                           gemm_name: str | None = None) -> jax.Array:
    """`mx_gemm_fp8` with its rhs given quantized: the same result, bit for bit.

    Args:
      a: the lhs as `mx_gemm_fp8` takes it (cast to ``operand_dtype`` first if given).
      q: the rhs's canonical MXFP4 operand ``[batch..., Fb, K']`` (the primal ``b`` of
        shape ``b_shape`` in the canonical layout, rotated by the recipe's Hadamard, K'
        padded to its size, quantized along K' with the rhs key: a quantized residual),
        carried in E4M3 (`packed_window`) and laid out as b's contraction view, so that
        the FP8 GEMM is `mx_gemm_fp8`'s; the emulation's branch reads it as b's values
        (`mxjax.emulation.in_place.mx_gemm_packed_rhs`).
      dims, recipe, k_lhs, signs, out_dtype, gemm_name: as `mx_gemm_fp8`'s.
    Returns:
      ``[batch..., lhs free..., rhs free...]`` (f32 or out_dtype).
    """
    if not takes_fp8_route(recipe):
        raise ValueError(f"recipe: the 'xla_fp8' backend takes MXFP4 x MXFP4, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    check_canonical_operand(q, "MXFP4", lambda fmt: fmt.name == "mxfp4")
    if operand_dtype is not None:
        a = a.astype(operand_dtype)
    (ca, _), (ba, _) = dims
    va = in_place.contraction_view(a, ba, ca)
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    k = va.x.shape[va.axis]
    k_out = k if h is None else -(-k // h) * h

    def finish(v, amax_bits):
        t, exact = carrier_window(amax_bits, recipe.lhs, LHS_CARRIER)
        return encode_exact(v, t, LHS_CARRIER), (t, exact)

    qa, (ta, exact_a) = in_place.mx_operand_values(va, recipe.lhs, key=k_lhs, finish=finish,
                                                   k_out=k_out, hadamard_size=h, signs=signs)
    tb, exact_b = packed_window(q, RHS_CARRIER)
    vb, b_axis, b_batch = in_place.packed_rhs_values(q, b_shape, dims, k_out, jnp.float32)
    qb = encode_exact(vb, tb, RHS_CARRIER)
    contract = (((va.axis,), (b_axis,)), (va.batch, b_batch))

    def emulated(a):
        return in_place.mx_gemm_packed_rhs(a, q, b_shape, dims, recipe, k_lhs, signs,
                                           out_dtype=out_dtype,
                                           row_chunks=FALLBACK_ROW_CHUNKS)

    return _carried_gemm((qa, ta, exact_a), (qb, tb, exact_b), contract, recipe, out_dtype,
                         k_out, gemm_name, emulated, (a,))


# The carriers' products: nonzero magnitudes in [2^lo, 2^hi) (E5M2's smallest subnormal
# 2^-16 times E4M3's 2^-9; 57344 * 448 < 2^25).
CARRIER_PRODUCT_EXPONENTS = (-25, 25)


def narrow_result(recipe, out_dtype) -> bool:
    """Whether a carriers' GEMM may round its f32 sums to bf16 itself: the result is bf16
    and no SR unscale (a multiply by 3/4) follows."""
    return (out_dtype is not None and jnp.dtype(out_dtype) == jnp.bfloat16
            and not any(op.sr_prescale for op in (recipe.lhs, recipe.rhs)))


def narrow_result_exact(e: jax.Array, k: int, products: tuple[int, int]) -> jax.Array:
    """bool scalar: ``bf16(acc) * 2^e == bf16(acc * 2^e)`` for every f32 sum ``acc`` of `k`
    products whose nonzero magnitudes lie in ``[2^lo, 2^hi)`` (``products``).

    A nonzero sum of such products is a multiple of 2^lo, so at least 2^lo, and below
    ``k * 2^hi``; scaling by 2^e commutes with rounding to bf16 while both ``acc`` and
    ``acc * 2^e`` are normal bf16 magnitudes (bf16 has f32's exponent range) and the
    rounded result does not overflow (one binade of margin).
    """
    lo, hi = products
    return (e + lo >= -126) & (e + hi + max(k - 1, 1).bit_length() + 1 <= 127)


def mx_dot_fp8(lhs_q, rhs_q) -> jax.Array:
    """f32 [lhs free, rhs free] (or batched): `mxjax.backends.mx_dot` of two MXFP4 MXArrays
    by the 'xla_fp8' route (the dot of the dequantized operands at HIGHEST where a block
    is outside its carrier's window)."""
    def operand(q, carrier):
        scale = q.scales.astype(jnp.int32)
        nb = scale.shape[q.axis]
        v = dequantize(q, jnp.float32)
        blocks = _bits.f32_bits(jnp.where(jnp.isnan(v), 0.0, v)) & _bits.ABS_MASK
        pad = nb * in_place.MX_BLOCK - v.shape[q.axis]
        blocks = jnp.pad(blocks, [(0, pad if i == q.axis else 0) for i in range(v.ndim)])
        shape = blocks.shape[:q.axis] + (nb, in_place.MX_BLOCK) + blocks.shape[q.axis + 1:]
        nonzero = jnp.max(blocks.reshape(shape), axis=q.axis + 1) != 0
        t, exact = window_of_exponents(scale - 127, nonzero & (scale != 255), carrier)
        return encode_exact(v, t, carrier), t, exact, v

    qa, ta, exact_a, va = operand(lhs_q, LHS_CARRIER)
    qb, tb, exact_b, vb = operand(rhs_q, RHS_CARRIER)
    nbatch = len(lhs_q.shape) - 2
    batch = tuple(range(nbatch))
    dims = (((lhs_q.axis,), (rhs_q.axis,)), (batch, batch))

    def fp8(qa, qb, va, vb):
        # Any GEMM of a model: promoted accumulation (an E5M2 lhs, f8_accumulation's rule).
        out = lax.dot_general(qa, qb, dims,
                              precision=f8_accumulation.f8_dot_precision(None, qa.dtype, qb.dtype),
                              preferred_element_type=jnp.float32)
        return _apply_pow2(out, ta + tb)

    def reference(qa, qb, va, vb):
        return lax.dot_general(va, vb, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    return lax.cond(exact_a & exact_b, fp8, reference, qa, qb, va, vb)


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del platform
    # The GEMM's name picks its accumulation: fast in fprop, promoted in dgrad and wgrad.
    route = functools.partial(mx_gemm_fp8, gemm_name=_accumulation_name(gemm_name))
    return in_place_route_gemm(route, a, b, dims=dims, recipe=recipe, key=key,
                               operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def _packed_rhs_gemm(a, packed_q, *, b_shape, dims, recipe, key, gemm_name,
                     operand_dtypes=None, out_dtype=None, platform=None) -> jax.Array:
    """``Route.packed_rhs_gemm``: `_gemm` with the rhs given quantized (a packed residual)."""
    del platform
    route = functools.partial(mx_gemm_fp8_packed_rhs, gemm_name=_accumulation_name(gemm_name))
    return in_place_route_packed_rhs_gemm(route, a, packed_q, b_shape=b_shape, dims=dims,
                                          recipe=recipe, key=key,
                                          operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def _packs_rhs(recipe, platform: str) -> bool:
    """``Route.packs_rhs``: not on a GPU. There this route re-quantizes X and W in place in
    the backward (XLA's bit view); packing them in the forward by XLA's canonical quantizer
    raised the deviceless H200 8B layer's temp memory from 1.21 to 1.65 GB without remat
    (1.13 to 1.09 under quantized_residuals); a one-pass Pallas pack gave 1.27 and 0.80,
    but that kernel ran 3x-10x slower than XLA's passes on an H200."""
    del recipe
    return platform != "gpu"


def _accumulation_name(gemm_name: str | None) -> str | None:
    """`f8_accumulation`'s name of a GEMM: 'fprop', 'dgrad' or 'wgrad', else None (a GEMM
    outside a policy's three, e.g. `mxjax.gemm`'s default 'gemm': promoted accumulation,
    the carriers' rule)."""
    return gemm_name if gemm_name in f8_accumulation.GEMM_NAMES else None


def _runs_on(chip: Chip) -> str:
    # XLA's FP8 GEMM: FP8 matrix units on an NVIDIA GPU; XLA:CPU computes f8 dots exactly.
    if chip.platform == "cpu" or (chip.platform == "gpu" and chip.fp8_units
                                  and not chip.is_amd):
        return ""
    if chip.platform == "gpu" and not chip.device_kind:
        return NO_GPU_TARGET
    return (f"needs FP8 matrix units with XLA FP8 GEMMs (NVIDIA sm_89+); device is "
            f"{chip.device_kind!r}")


def _packed_dot(lhs_q, rhs_q, *, platform=None, **tiles) -> jax.Array:
    del platform, tiles
    return mx_dot_fp8(lhs_q, rhs_q)


ROUTE = Route(
    name="xla_fp8",
    summary="MXFP4 carried exactly in FP8 on XLA's FP8 GEMM (Hopper's FP8 tensor cores)",
    formats=("mxfp4",),
    runs_on=_runs_on,
    gemm=_gemm,
    packed_dot=_packed_dot,
    evidence=("layer_8b.h200.measured", "layer_8b.h200.rates_roofline",
              "layer_8b.b200.rates_roofline", "gemm_8192.h200.measured"),
    packed_rhs_gemm=_packed_rhs_gemm,
    packs_rhs=_packs_rhs,
)
