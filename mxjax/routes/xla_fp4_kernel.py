"""One-pass MXFP4 operand kernel for the 'xla_fp4' route: E2M1 codes and scales in the MMA's layout.

`mxfp4_operand_pair` reads a 2-D operand once and writes, for both of its axes, what
Blackwell's block-scaled MMA reads: packed E2M1 codes ``[F, K/2]`` (contraction last,
whichever axis of the input it was) and each 32-block's E8M0 byte for both of its
16-halves ``[F, K/16]`` (NVFP4's scale layout), plus each tile's largest and smallest live
scale exponent (the 'xla_fp4' window's shift and exactness come from those, not from a
second read). `mxfp4_operand` writes one axis. The codes are `mxjax.quantize`'s of the
rotated f32 operand and the route's operands the XLA form's, bit for bit
(`tests/mxjax/routes/test_xla_fp4_kernel.py`, Pallas interpreter).

**Why elementwise across strided slices.** The kernel never reshapes, splits or
transposes a register tile in order to reach a block's elements: Triton lowers those
through shared-memory layout conversions (the previous one-pass kernel,
`mxjax.kernels.fused_quantize`, ran 3-10x slower than XLA's passes on an H200). Instead it
loads a tile (`Launch`: 128 x 128, or 128 x 64 on Hopper and Blackwell, where fewer
registers per thread let more blocks share an SM) as 32 strided slices, slice ``j``
holding element ``j`` of every 32-block (``x[:, j::32]`` along rows, ``x[j::32, :]``
along columns), so the Hadamard
butterfly, the block amax, the scale and the rounding are elementwise operations between
slices of one layout. A bf16 operand is read as uint32 pairs: along rows, 16 slices of
two elements each (4-byte loads 64 bytes apart, the cache lines shared by the 16 loads);
along columns, rows of pairs (coalesced), whose even and odd columns are two slice sets.
The codes of elements ``2p`` and ``2p + 1`` form byte ``p`` of a block, stored with
stride 16 (transposed first along columns: the only layout conversions, PTX: 98
shared-memory accesses per thread).

**Arithmetic.** The same f32 operations as `mxjax.emulation.in_place.mx_operand_values`:
the signs multiply, the butterfly's first log2(h) - 1 stages (stage t pairs elements ``i``
and ``i + 2^t`` of an h-group: ``a + b``, ``a - b``), the block amax from ``|a| + |b|`` of
the last stage's pairs (h <= 32) times 1/sqrt(h), the scale exponent s by the scheme, the
last stage; then ``y = r * (1/sqrt(h) * 2^-s)`` rounded on the E2M1 grid and its code
written: to nearest even by `nearest_even_code` (integer operations on one f32 sum), or
where the chip has it by PTX's ``cvt.rn.satfinite.e2m1x2.f32``, one instruction per
code byte (``e2m1_cvt``: SASS per element of a bf16 pair on B200, 54 -> 34); the other
deterministic roundings by `mxjax.elements.round_to_value`. The codes are the route's
``q`` without forming ``q * 2^s`` first.

Scope: E8M0 MXFP4 operands, a Hadamard of 16 or 32 or none, deterministic rounding
without the SR pre-scale, bf16 or f32 input. Other operands take the route's XLA form
(`takes_kernel`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mxjax import _bits, elements
from mxjax.elements import round_to_value
from mxjax.formats import E2M1, Rounding
from mxjax.routes import threefry

__all__ = ["DEFAULT_LAUNCH", "NONFINITE_SENTINEL", "TILE", "Launch", "Mxfp4Codec", "SliceDraws",
           "abs_max_bits", "check_contraction", "check_matrix", "cvt_e2m1x2", "group_slices",
           "has_e2m1_cvt", "kernel_name", "launch_for", "mxfp4_operand", "mxfp4_operand_pair",
           "nearest_even_code", "quantize_slices", "rotate_slices", "run_codec", "signs_array",
           "takes_kernel"]

_MX = 32
_NV = 16  # NVFP4's scale block: the MMA's scales are per 16 elements
TILE = 128  # the default tile's rows and columns (`Launch`)
# s_max of a tile holding a non-finite block: above every exactness bound.
NONFINITE_SENTINEL = 1 << 20
_NO_LIVE = 1 << 21
_MIN_EXP, _MAX_EXP = -126, 127


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """How `run_codec` tiles and launches a kernel; the codes are the same bit for bit
    under every launch (each block lies in one tile, the statistics are maxima).

    ``rows`` x ``cols``: the tile (multiples of 32; a pair's two directions both come
    from one tile). ``row_parts``: blocks along rows (direction 1) are processed in this
    many chunks of the tile's rows, one after the other; ``col_parts``: blocks along
    columns (direction 0) in chunks of its columns. A thread then holds 1/parts of the
    32-slice set at a time: fewer live registers, the same instructions as long as each
    chunk's slices still span the block's threads (smaller ones are replicated across
    threads). ``num_warps``, ``num_stages``: Triton's. ``col_pairs``: a kernel that
    blocks along columns only reads a bf16 operand as uint32 pairs (two slice sets at
    once, as a pair kernel must) or, False, element by element (one set: fewer
    registers).
    """

    rows: int = TILE
    cols: int = TILE
    row_parts: int = 1
    col_parts: int = 1
    num_warps: int = 8
    num_stages: int = 1
    col_pairs: bool = True

    def __post_init__(self):
        for name in ("rows", "cols"):
            n = getattr(self, name)
            if n % _MX or n & (n - 1):
                raise ValueError(f"{name}: expected a power of two >= 32, got {n}")
        for name, n in (("row_parts", self.rows), ("col_parts", self.cols // 2)):
            p = getattr(self, name)
            if p < 1 or p & (p - 1) or p > n:
                raise ValueError(f"{name}: expected a power of two up to {n}, got {p}")


# Square 128-tiles, 8 warps, all slices at once: 64 f32 values of a slice set per thread
# (the interpreter's launch, and a GPU's without an entry in `_LAUNCHES`).
DEFAULT_LAUNCH = Launch()
# Hopper and Blackwell: 128 x 64 tiles, 4 warps, rows in 2 chunks. Every slice load is then
# one element per thread in both directions (along rows a 64-row chunk, [64, 2] words;
# along columns [4, 32]), so a thread holds 32 values of a set, not 64: ptxas gives it 80
# registers, not 102 (B200; 96, not 99, on the H200), and 6 blocks of 128 threads fit an
# SM (37.5% occupancy) where 2 of 256 did (25%), for the same SASS per element. The
# calibrated model's pair kernel at [8192, 4096]: 126 -> 83 us on the B200, 213 -> 168 on
# the H200 (bench/operand_kernel_launch.py). Column chunks would make the loads along
# columns narrower than the block's threads (replicated: more SASS); 16 warps on 128-tiles
# replicate them too (112 registers, 1 block); loading the odd columns' set again after the
# even one's stores held more registers, not fewer.
_TUNED = Launch(rows=128, cols=64, row_parts=2, num_warps=4)
# A kernel of one direction there: 64 x 64 tiles over 4 warps, bf16 along columns read
# element by element. B200, [8192, 4096] (bench/operand_kernel_launch.py, calibrated):
# NVFP4 along rows 147 -> 103 us (96 -> 72 registers), along columns 158 -> 99 (95 -> 56);
# with stochastic rounding's draws 403 -> 275 and 483 -> 249; MXFP4 35 -> 33, 49 -> 36.
_ONE_DIRECTION = Launch(rows=64, cols=64, num_warps=4, col_pairs=False)
_LAUNCHES: dict[tuple[int, int], tuple[Launch, Launch]] = {
    (9, 0): (_TUNED, _ONE_DIRECTION), (10, 0): (_TUNED, _ONE_DIRECTION)}


def launch_for(compute_capability: tuple[int, int] | None, *,
               directions: tuple[int, ...] = (1, 0)) -> Launch:
    """The launch of the kernels compiled for a GPU of this compute capability (by major
    version; `DEFAULT_LAUNCH` for others), for a kernel of these directions (a pair's or
    one's)."""
    if compute_capability is None:
        return DEFAULT_LAUNCH
    pair, one = _LAUNCHES.get((compute_capability[0], 0), (DEFAULT_LAUNCH, DEFAULT_LAUNCH))
    return pair if len(directions) > 1 else one


def has_e2m1_cvt(compute_capability: tuple[int, int] | None) -> bool:
    """Whether the GPU of this compute capability has PTX's ``cvt.rn.satfinite.e2m1x2.f32``
    (sm_100a, sm_103a, sm_110a, sm_120a: Blackwell; ptxas 13.0 rejects it for sm_90a)."""
    return compute_capability is not None and compute_capability[0] in (10, 11, 12)


def takes_kernel(op, hadamard_size: int | None, dtype) -> bool:
    """Whether `mxfp4_operand` computes this operand (MXFP4, h in {None, 16, 32},
    deterministic rounding, bf16 or f32 input)."""
    elem = op.fmt.element
    return (elem is not None and elem.name == "e2m1" and op.fmt.scale == "e8m0"
            and op.fmt.block_size == _MX and op.rounding is not Rounding.STOCHASTIC
            and not op.sr_prescale
            and hadamard_size in (None, 16, 32)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))


def _e2m1_code(q):
    """The E2M1 code (int32, sign in bit 3) of f32 ``q``, an E2M1 value (±0, 0.5, ..., 6).

    ``bits >> 22`` of a magnitude is ``(exponent << 1) | top mantissa bit``: 252 for 0.5,
    254 for 1, ... 259 for 6, so the code is that minus 252 (0.5, E2M1's subnormal,
    raised to 1) and 0 for zero.
    """
    bits = _bits.f32_bits(q)
    top = ((bits >> 22) & 0x1FF).astype(jnp.int32)
    mag = jnp.where(top == 0, 0, jnp.maximum(top - 252, 1))
    return mag | ((bits >> 31).astype(jnp.int32) << 3)


def nearest_even_code(y):
    """The E2M1 code (int32, sign in bit 3) of f32 ``y`` rounded to nearest, ties to
    even, on the E2M1 grid and saturated (`mxjax.elements.nearest_even_code`: integer
    operations on one f32 sum; any y but NaN, whose code is never read)."""
    sign, code = elements.nearest_even_code(y, E2M1)
    return code | (sign << 3).astype(jnp.int32)


def cvt_e2m1x2(even, odd):
    """Byte p of a block from its elements 2p (low nibble) and 2p + 1 (high), by PTX's
    ``cvt.rn.satfinite.e2m1x2.f32`` (sm_100a): the source written first fills the high
    nibble."""
    from jax.experimental.pallas import triton as plt

    (out,) = plt.elementwise_inline_asm(
        "{ .reg .b8 byte; cvt.rn.satfinite.e2m1x2.f32 byte, $2, $1; cvt.u32.u8 $0, byte; }",
        args=[even, odd], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(even.shape, jnp.int32)])
    return out


def abs_max_bits(values):
    """The uint32 abs bits of the largest magnitude among f32 arrays of one shape (elementwise
    across the list: a block's amax when the list holds its slices)."""
    return functools.reduce(jnp.maximum, [_bits.f32_bits(v) & _bits.ABS_MASK for v in values])


def group_slices(x2: jax.Array, axis: int) -> list[jax.Array]:
    """The 32 strided slices of a 2-D array along ``axis`` (0 or 1) that `rotate_slices`
    takes: slice j holds element j of every 32-group (the axis zero-padded to a multiple
    of 32), the other axis kept. Outside a kernel XLA fuses them with their consumer."""
    pad = (-x2.shape[axis]) % _MX
    if pad:
        widths = [(0, 0), (0, 0)]
        widths[axis] = (0, pad)
        x2 = jnp.pad(x2, widths)
    if axis == 1:
        groups = x2.reshape(x2.shape[0], -1, _MX)
        return [groups[:, :, j] for j in range(_MX)]
    groups = x2.reshape(-1, _MX, x2.shape[1])
    return [groups[:, j, :] for j in range(_MX)]


def rotate_slices(xs, hadamard_size, signs, *, last_stage=True):
    """The Hadamard butterflies on 32 slices (``xs[j]``: element j of every 32-group), not
    normalized: the signs multiply, then stage t pairs elements ``i`` and ``i + 2^t`` of
    each h-group (``a + b``, ``a - b``), the stages of `mxjax.hadamard` in its order.
    ``last_stage=False`` leaves the last one out (the caller takes the block amax from
    its pairs). No rotation (h None): the slices as they are."""
    z = list(xs)
    h = hadamard_size
    if h is None:
        return z
    if signs is not None:
        z = [v * signs[j % h] for j, v in enumerate(z)]
    k = h.bit_length() - 1
    for t in range(k if last_stage else k - 1):
        step = 1 << t
        for j in range(_MX):
            if not j & step:
                a, b = z[j], z[j + step]
                z[j], z[j + step] = a + b, a - b
    return z


def quantize_slices(xs, op, hadamard_size, signs, e2m1_cvt=False):
    """The block quantizer on 32 slices: ``xs[j]`` holds element j of every block.

    Args:
      xs: 32 f32 arrays of one shape (a block per position).
      op: the OperandRecipe (`takes_kernel`).
      hadamard_size: 16, 32 or None.
      signs: None or the rotation's signs, indexable by the position in an h-group
        (f32 scalars).
      e2m1_cvt: round to nearest even by PTX's ``cvt.rn.satfinite.e2m1x2.f32``
        (`has_e2m1_cvt`; compiled kernels only) instead of `nearest_even_code`: the same
        codes (IEEE round to nearest even, saturated at 6), one instruction per pair.
        Other roundings ignore it.
    Returns:
      (16 int32 code bytes (elements 2p, 2p + 1), int32 scale exponents s, bool live,
      bool nonfinite), each of the slices' shape.
    """
    h = hadamard_size
    fast = op.rounding is Rounding.NEAREST_EVEN and not op.sr_prescale
    z = rotate_slices(xs, h, signs, last_stage=False)
    if h is None:
        r = z
        amax_bits = abs_max_bits(z)
        norm = 1.0
    else:
        half = h // 2
        lows = [j for j in range(_MX) if not j & half]
        sums = [_bits.bits_f32(_bits.f32_bits(z[j]) & _bits.ABS_MASK)
                + _bits.bits_f32(_bits.f32_bits(z[j + half]) & _bits.ABS_MASK) for j in lows]
        norm = 1.0 / math.sqrt(h)
        amax_bits = abs_max_bits(sums)
        amax_bits = _bits.f32_bits(_bits.bits_f32(amax_bits) * jnp.float32(norm))
        r = list(z)
        for j in lows:
            a, b = z[j], z[j + half]
            r[j], r[j + half] = a + b, a - b
        if not fast:
            r = [v * jnp.float32(norm) for v in r]
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    # y = r * norm * 2^-s on the element grid, rounded there: the in-place forms' ``q``
    # (values_from_amax; nearest_even_values is the same values), without forming the
    # values ``q * 2^s`` first. ``norm * 2^-s`` is exact (s in [-126, 125] for finite
    # blocks), so one multiply rounds as ``(r * norm) * 2^-s`` does wherever y is normal;
    # smaller y round to zero on the grid either way. Non-finite blocks' codes are never
    # read (the route takes the emulation).
    factor = _bits.pow2(jnp.clip(-s, _MIN_EXP, _MAX_EXP))
    if fast and h is not None:
        factor = factor * jnp.float32(norm)
    live = (amax_bits != 0) & ~nonfinite
    if fast and e2m1_cvt:
        y = [v * factor for v in r]
        return ([cvt_e2m1x2(y[2 * p], y[2 * p + 1]) for p in range(_MX // 2)], s, live,
                nonfinite)
    codes = []
    for v in r:
        y = v * factor
        if fast:
            codes.append(nearest_even_code(y))
        else:
            codes.append(_e2m1_code(round_to_value(y, op.fmt.element, op.rounding, None)))
    packed = [codes[2 * p] | (codes[2 * p + 1] << 4) for p in range(_MX // 2)]
    return packed, s, live, nonfinite


def _slices(x_ref, direction: int, pairs: bool, bf16_values: bool, chunk):
    """One chunk of the tile's 32 slices for one direction: lists of f32 arrays, one list
    per set of columns the loads produce (bf16 pairs read as uint32 give two sets
    column-wise: the even and the odd columns).

    direction 1 (blocks along the tile's columns): slice j = ``x[chunk, j::32]``, the
    chunk a range of rows; direction 0 (blocks along its rows): slice j = ``x[j::32,
    chunk]``, the chunk a range of columns (of uint32 pairs for pairs).
    """
    rows, width = x_ref.shape
    if not pairs:
        def value(v):  # an f32 operand, rounded to bf16 first when the GEMM casts it
            v = v.astype(jnp.bfloat16) if bf16_values else v
            return v.astype(jnp.float32)

        if direction == 1:
            return [[value(x_ref[chunk, pl.ds(j, width // _MX, stride=_MX)])
                     for j in range(_MX)]]
        return [[value(x_ref[pl.ds(j, rows // _MX, stride=_MX), chunk]) for j in range(_MX)]]

    def split(w):  # uint32 of a bf16 pair -> (element 2i, element 2i + 1) as f32
        return _bits.bits_f32(w << 16), _bits.bits_f32((w >> 16) << 16)

    if direction == 1:
        xs = []
        for i in range(_MX // 2):
            xs += split(x_ref[chunk, pl.ds(i, 2 * width // _MX, stride=_MX // 2)])
        return [xs]
    # (Loading the odd set again after the even one is stored held more registers, not
    # fewer: ptxas schedules by its own measure.)
    even, odd = zip(*(split(x_ref[pl.ds(j, rows // _MX, stride=_MX), chunk])
                      for j in range(_MX)))
    return [list(even), list(odd)]


def _stats(s, live, nonfinite):
    """(s_max, -s_min) of one tile's live blocks; s_max is the sentinel for a non-finite
    block (a max, not jnp.any: Pallas' Triton lowering has no reduce_or)."""
    s_max = jnp.max(jnp.where(live, s, -_NO_LIVE))
    s_max = jnp.maximum(s_max, jnp.max(jnp.where(nonfinite, NONFINITE_SENTINEL, -_NO_LIVE)))
    return s_max, jnp.max(jnp.where(live, -s, -_NO_LIVE))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mxfp4Codec:
    """What the kernel writes for an MXFP4 operand (`quantize_slices`): 16 code bytes and
    each 32-block's E8M0 byte twice (NVFP4's per-16 layout) per 32-group, and the window
    statistics (s_max, -s_min)."""

    op: object
    hadamard_size: int | None
    e2m1_cvt: bool = False
    name: ClassVar[str] = "mxfp4_operand"
    code_columns: ClassVar[int] = _MX // 2
    scale_columns: ClassVar[int] = 2
    n_stats: ClassVar[int] = 2
    has_param: ClassVar[bool] = False
    draw_columns: ClassVar[tuple[int, ...]] = ()  # no stochastic rounding

    def encode(self, xs, signs, param):
        del param
        packed, s, live, nonfinite = quantize_slices(xs, self.op, self.hadamard_size, signs,
                                                     self.e2m1_cvt)
        scale_bytes = jnp.where(nonfinite, 255, s + 127)
        return packed, [scale_bytes, scale_bytes], list(_stats(s, live, nonfinite))


@dataclasses.dataclass(frozen=True)
class SliceDraws:
    """``jax.random.uniform``'s draws for a set of 32 slices (`mxjax.routes.threefry`): the
    key's words and the flat index ``(hi, lo)`` of slice 0's elements in the canonical
    ``[F, K]`` operand; slice j's elements lie j further along K."""

    k0: jax.Array
    k1: jax.Array
    hi: jax.Array
    lo: jax.Array
    legacy: bool

    def slice(self, j: int):
        """f32 uniforms of slice j (the slices' shape)."""
        lo = self.lo + jnp.uint32(j)
        hi = self.hi + (lo < self.lo).astype(jnp.uint32)
        return threefry.uniform_at(self.k0, self.k1, hi, lo, legacy=self.legacy)


def _set_draws(keys_ref, d, columns, direction, pairs, x_shape, q, n, c, legacy):
    """`SliceDraws` of one set of one direction's chunk q (n rows, or n columns of words)
    of the tile: the set's F and K positions from the tile's place in the grid."""
    tr = x_shape[0]
    tc = x_shape[1] * (2 if pairs else 1)
    n_dirs = (keys_ref.shape[0] - 2) // 2
    # The shard's origin in the whole operand (0, 0 unsharded), after the key words.
    row0 = keys_ref[2 * n_dirs] + (pl.program_id(0) * tr).astype(jnp.uint32)
    col0 = keys_ref[2 * n_dirs + 1] + (pl.program_id(1) * tc).astype(jnp.uint32)
    if direction == 1:  # slice j = x[chunk, j::32]: F the row, K the column
        shape = (n, tc // _MX)
        free = row0 + jnp.uint32(q * n) + lax.broadcasted_iota(jnp.uint32, shape, 0)
        k = col0 + jnp.uint32(_MX) * lax.broadcasted_iota(jnp.uint32, shape, 1)
    else:  # slice j = x[j::32, chunk]: F the column (of a pair's set c), K the row
        shape = (tr // _MX, n)
        word = jnp.uint32(q * n) + lax.broadcasted_iota(jnp.uint32, shape, 1)
        free = col0 + (jnp.uint32(2) * word + jnp.uint32(c) if pairs else word)
        k = row0 + jnp.uint32(_MX) * lax.broadcasted_iota(jnp.uint32, shape, 0)
    hi, lo = threefry.flat_index(free, columns, k)
    return SliceDraws(keys_ref[2 * d], keys_ref[2 * d + 1], hi, lo, legacy)


def _kernel(*refs, directions, codec, pairs, has_signs, bf16_values, row_parts, col_parts):
    """One tile, every direction: the codec's code and scale columns stored with stride into
    the [F, K] layout, and one row of its statistics (each reduced by a max). Each
    direction runs over its slices in chunks (`Launch`). A codec that rounds
    stochastically (``draw_columns``) also gets each set's `SliceDraws`."""
    x_ref, *rest = refs
    signs_ref = rest.pop(0) if has_signs else None
    params_ref = rest.pop(0) if codec.has_param else None
    keys_ref = rest.pop(0) if codec.draw_columns else None
    stats_ref = rest.pop() if codec.n_stats else None
    outs = rest
    signs = None
    if has_signs:
        signs = [signs_ref[i] for i in range(codec.hadamard_size)]
    stats = []
    for d, (direction, (codes_ref, scales_ref)) in enumerate(
            zip(directions, zip(outs[::2], outs[1::2]))):
        param = params_ref[d] if codec.has_param else None
        # The chunks: ranges of the tile's rows (direction 1) or of its columns (0).
        parts = row_parts if direction == 1 else col_parts
        n = x_ref.shape[0 if direction == 1 else 1] // parts
        totals = None
        for q in range(parts):
            chunk = pl.ds(q * n, n)
            sets = _slices(x_ref, direction, pairs, bf16_values, chunk)
            for c, xs in enumerate(sets):
                if codec.draw_columns:
                    draws = _set_draws(keys_ref, d, codec.draw_columns[d], direction, pairs,
                                       x_ref.shape, q, n, c, codec.legacy_uniforms)
                    codes, scales, tile_stats = codec.encode(xs, signs, param, draws)
                else:
                    codes, scales, tile_stats = codec.encode(xs, signs, param)
                # Free rows of the [F, K] output this set fills: the chunk's, or every
                # other one of the chunk's pairs.
                rows = chunk if len(sets) == 1 else pl.ds(2 * q * n + c, n, stride=2)
                if direction == 0:  # slices [K/32, F] -> the [F, K] layout
                    codes = [v.T for v in codes]
                    scales = [v.T for v in scales]
                nb = codes[0].shape[1]  # blocks per row of the tile's output
                for p, byte in enumerate(codes):
                    codes_ref[rows, pl.ds(p, nb, stride=len(codes))] = byte.astype(jnp.uint8)
                for p, byte in enumerate(scales):
                    scales_ref[rows, pl.ds(p, nb, stride=len(scales))] = byte.astype(
                        jnp.uint8)
                totals = tile_stats if totals is None else [
                    jnp.maximum(a, b) for a, b in zip(totals, tile_stats)]
        stats += totals
    if not stats:
        return
    # One stats row per tile, reduced by one max over all tiles.
    column = lax.broadcasted_iota(jnp.int32, (1, len(stats)), 1)
    row = jnp.full((1, len(stats)), stats[-1], jnp.int32)
    for i, value in enumerate(stats[:-1]):
        row = jnp.where(column == i, value, row)
    stats_ref[...] = row


def _check(x2, op, hadamard_size, e2m1_cvt, interpret):
    if e2m1_cvt and interpret:
        raise ValueError("e2m1_cvt: PTX's cvt has no interpreter form; pass e2m1_cvt=False "
                         "with interpret=True")
    check_matrix(x2)
    if not takes_kernel(op, hadamard_size, x2.dtype):
        raise ValueError(f"op, hadamard_size, x2: the kernel takes MXFP4 with h in "
                         f"(None, 16, 32), deterministic rounding and a bf16 or f32 operand; "
                         f"got {op!r}, h={hadamard_size}, {x2.dtype}")


def check_matrix(x2):
    """Refuses an operand that is not 2-D."""
    if x2.ndim != 2:
        raise ValueError(f"x2: expected a 2-D array, got shape {x2.shape}")


def run_codec(x2, signs, params, *, directions, codec, interpret, bf16_values=False,
              launch: Launch | None = None, keys=None):
    """The one-pass kernel of a codec over x2 padded with zeros to whole tiles.

    Args:
      x2: bf16 or f32 ``[R, C]``.
      signs: the Hadamard's f32 ``[h]`` signs or None.
      params: f32 ``[len(directions)]``, one scalar per direction for a codec that takes
        one (NVFP4's tensor scale), else None.
      directions: the axes to quantize along, in order: 1 (blocks along rows), 0 (along
        columns).
      codec: what to compute and write per tile (`Mxfp4Codec` and the NVFP4/MXFP8
        codecs); hashable.
      interpret: run in the Pallas interpreter.
      bf16_values: round an f32 x2 to bf16 in the kernel first.
      launch: the tiles and Triton's launch parameters (the same bits under any); None:
        `DEFAULT_LAUNCH` in the interpreter, else `launch_for` the GPU traced for.
      keys: uint32 ``[2 * len(directions)]``, each direction's key words
        (`mxjax.routes.threefry.key_words`), for a codec that draws uniforms
        (``draw_columns``: the canonical K of each direction, the row length of its
        draws; the draws are at x2's positions, K along the direction's axis); else None.
    Returns:
      per direction ``(codes, scale bytes, stats)``: uint8 ``[F, K * code_columns / 32]``
      and ``[F, K * scale_columns / 32]`` (F, K the tile-padded sizes) and the codec's
      int32 statistics ``[n_stats]`` (each a max over tiles).
    """
    launch = _launch_or_default(launch, interpret, directions)
    _check_keys(codec, keys)
    return _run_codec(x2, signs, params, _with_origin(keys), directions=directions,
                      codec=codec, interpret=interpret, bf16_values=bf16_values, launch=launch)


def kernel_name(codec, directions) -> str:
    """The Triton kernel's name: the codec's for a pair (both directions), with the one
    direction (``_rows``: blocks along x2's rows, axis 1; ``_cols``), the Hadamard size
    and ``_sr`` (draws uniforms) for others, so that profiles and the cost model's match
    of calls to compiled kernels (by name and grid) tell the variants apart."""
    name = codec.name
    if tuple(directions) != (1, 0):
        name += "".join("_rows" if d == 1 else "_cols" for d in directions)
        if codec.hadamard_size:
            name += f"_h{codec.hadamard_size}"
    if codec.draw_columns:
        name += "_sr"
    return name


def _launch_or_default(launch, interpret, directions) -> Launch:
    """`launch`, or when None the interpreter's `DEFAULT_LAUNCH` or `launch_for` the GPU
    traced for and these directions."""
    if launch is not None:
        return launch
    if interpret:
        return DEFAULT_LAUNCH
    from mxjax.chips import target_chip

    return launch_for(target_chip("gpu").compute_capability, directions=tuple(directions))


def _check_keys(codec, keys):
    if bool(codec.draw_columns) != (keys is not None):
        raise ValueError(f"keys: expected the key words exactly for a codec that draws "
                         f"uniforms; codec draws: {bool(codec.draw_columns)}, keys: "
                         f"{keys is not None}")


def _with_origin(keys, origin=None):
    """The kernel's uint32 key input: the key words, then the origin of x2 (a shard's) in
    the whole operand, (0, 0) by default; None without keys."""
    if keys is None:
        return None
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1)
    if origin is None:
        origin = jnp.zeros((2,), jnp.uint32)
    return jnp.concatenate([keys, jnp.asarray(origin, jnp.uint32).reshape(2)])


# Jitted (its trace cached per operand type and codec): two GEMMs that quantize the same
# operand the same way make the same call, whose kernel then lowers to the same Triton
# module, locations included (they hold the traceback of the trace), so XLA merges the
# two calls (CSE). Traced anew in each GEMM, the tracebacks would differ.
@functools.partial(jax.jit, static_argnames=("directions", "codec", "interpret",
                                             "bf16_values", "launch"))
def _run_codec(x2, signs, params, keys, *, directions, codec, interpret, bf16_values, launch):
    tr, tc = launch.rows, launch.cols
    r, c = -(-x2.shape[0] // tr) * tr, -(-x2.shape[1] // tc) * tc
    x2 = jnp.pad(x2, ((0, r - x2.shape[0]), (0, c - x2.shape[1])))
    grid = (r // tr, c // tc)
    pairs = x2.dtype == jnp.bfloat16 and (launch.col_pairs or tuple(directions) != (0,))
    if pairs:  # free in XLA: a bitcast of the row-major buffer
        x2 = lax.bitcast_convert_type(x2.reshape(r, c // 2, 2), jnp.uint32)
    inputs = [x2]
    in_specs = [pl.BlockSpec((tr, tc // 2 if pairs else tc), lambda i, j: (i, j))]
    if signs is not None:
        inputs.append(signs)
        in_specs.append(pl.BlockSpec((codec.hadamard_size,), lambda i, j: (0,)))
    if codec.has_param:
        inputs.append(jnp.asarray(params, jnp.float32).reshape(len(directions)))
        in_specs.append(pl.BlockSpec((len(directions),), lambda i, j: (0,)))
    if codec.draw_columns:
        inputs.append(keys)
        in_specs.append(pl.BlockSpec((2 * len(directions) + 2,), lambda i, j: (0,)))
    code_w, scale_w = codec.code_columns, codec.scale_columns
    out_shape, out_specs = [], []
    for direction in directions:
        f, k = (r, c) if direction == 1 else (c, r)
        out_shape += [jax.ShapeDtypeStruct((f, k * code_w // _MX), jnp.uint8),
                      jax.ShapeDtypeStruct((f, k * scale_w // _MX), jnp.uint8)]
        index = (lambda i, j: (i, j)) if direction == 1 else (lambda i, j: (j, i))
        tf, tk = (tr, tc) if direction == 1 else (tc, tr)
        out_specs += [pl.BlockSpec((tf, tk * code_w // _MX), index),
                      pl.BlockSpec((tf, tk * scale_w // _MX), index)]
    n_stats = codec.n_stats * len(directions)
    if n_stats:
        out_shape.append(jax.ShapeDtypeStruct((grid[0], grid[1] * n_stats), jnp.int32))
        out_specs.append(pl.BlockSpec((1, n_stats), lambda i, j: (i, j)))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        compiler_params = plt.CompilerParams(num_warps=launch.num_warps,
                                             num_stages=launch.num_stages)
    outs = pl.pallas_call(
        functools.partial(_kernel, directions=directions, codec=codec, pairs=pairs,
                          has_signs=signs is not None, row_parts=launch.row_parts,
                          col_parts=launch.col_parts,
                          bf16_values=bf16_values and x2.dtype == jnp.float32),
        out_shape=tuple(out_shape),
        grid=grid,
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        interpret=interpret,
        compiler_params=compiler_params,
        name=kernel_name(codec, directions),
    )(*inputs)
    if n_stats:
        *outs, stats = outs
        totals = jnp.max(stats.reshape(-1, n_stats), axis=0)
    else:
        totals = jnp.zeros((0,), jnp.int32)
    m = codec.n_stats
    return [(outs[2 * d], outs[2 * d + 1], totals[m * d:m * (d + 1)])
            for d in range(len(directions))]


# --------------------------------------------------------------------------- #
# Sharded operands: each device quantizes its own shard (custom_partitioning)
# --------------------------------------------------------------------------- #
# A Pallas kernel is a custom call that XLA's SPMD partitioner cannot split: left alone it
# gathers the whole operand on every device and quantizes all of it there (FSDP, 8B layer on
# 8 B200s: 448 MiB activation gathers). Every block lies along one axis and the statistics
# are maxima, so the kernel runs per shard wherever no block crosses a shard boundary, and
# the statistics take one max over the devices holding the shards.

def _mesh_size(mesh, entry) -> int:
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[n] for n in names)


def _entry_names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def shard_spec(mesh, spec, shape, directions, hadamard_size) -> tuple:
    """The partition of x2 the kernel runs on, from the one XLA proposes (``spec``: one
    entry per axis): an axis keeps its mesh axes where they divide it and, along an axis
    some direction blocks along, each shard holds whole 32-blocks and Hadamard blocks;
    otherwise that axis is gathered (the whole operand's kernel, as unsharded)."""
    step = max(_MX, hadamard_size or 1)
    blocked = {1 if d == 1 else 0 for d in directions}
    out = []
    for ax, entry in enumerate(tuple(spec) + (None,) * (2 - len(spec))):
        n = _mesh_size(mesh, entry)
        if n > 1 and (shape[ax] % n or (ax in blocked and (shape[ax] // n) % step)):
            entry = None
        out.append(entry if n > 1 else None)
    return tuple(out)


def _trim_codec(out, shape, directions, codec):
    """run_codec's tile-padded results cut to x2's own sizes (K padded to 32)."""
    r, c = shape
    res = []
    for d, (codes, scales, stats) in zip(directions, out):
        f, k = (r, c) if d == 1 else (c, r)
        kp = -(-k // _MX) * _MX
        res.append((codes[:f, :kp * codec.code_columns // _MX],
                    scales[:f, :kp * codec.scale_columns // _MX], stats))
    return res


def _codec_local(x2, extras, directions, codec, interpret, bf16_values, launch,
                 origin=None):
    signs, params, keys = extras
    out = _run_codec(x2, signs, params, _with_origin(keys, origin), directions=directions,
                     codec=codec, interpret=interpret, bf16_values=bf16_values, launch=launch)
    return _trim_codec(out, x2.shape, directions, codec)


# The kernel's small replicated inputs, in order: the Hadamard's signs, the per-direction
# params, the key words (each present or not: the ``has`` flags).
_EXTRAS = ("hs", "pp", "kk")


def _split_extras(rest, has):
    """(signs, params, keys) from the present ones, in `_EXTRAS`' order."""
    rest = list(rest)
    return tuple(rest.pop(0) if h else None for h in has)


def _codec_rule(directions, codec, interpret, bf16_values, launch, has, mesh, value_types,
                result_types):
    """The Shardy rule: results follow x2's rows and columns (codes and scales along K by
    whole 32-groups, as the factor of an axis' 32-groups); statistics, signs, params and
    keys are replicated. `_codec_partition` decides the partition itself."""
    del interpret, bf16_values, launch, mesh, result_types
    from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule
    from jax.extend.mlir import ir

    shape = dict(zip("rc", ir.RankedTensorType(value_types[0]).shape))
    sizes: dict = {}
    whole: set = set()

    def groups(name):  # an axis of x2 (or a result's F axis): (32-groups, 32) when it has them
        n = shape[name]
        if n % _MX or n == _MX:
            whole.add(name)
            return name
        sizes[name], sizes[name + "w"] = n // _MX, _MX
        return CompoundFactor(name, name + "w")

    def along(name, columns, tag):  # a result's K axis: n / 32 * columns
        n = shape[name]
        if n % _MX or n == _MX:  # never sharded (`shard_spec`): a factor of its own
            whole.add(name + tag)
            return name + tag
        sizes[name] = n // _MX
        if columns == 1:
            whole.add(name)
            return name
        sizes[name + tag] = columns
        return CompoundFactor(name, name + tag)

    operands = [ArrayMapping(groups("r"), groups("c"))]
    replicated = []
    for present, name in zip(has, _EXTRAS):
        if present:
            operands.append(ArrayMapping(name))
            replicated.append(name)
    results = []
    for i, d in enumerate(directions):
        f, k = ("r", "c") if d == 1 else ("c", "r")
        results.append(ArrayMapping(groups(f), along(k, codec.code_columns, f"q{i}")))
        results.append(ArrayMapping(groups(f), along(k, codec.scale_columns, f"s{i}")))
        results.append(ArrayMapping(f"t{i}"))
        replicated.append(f"t{i}")
    sizes = {name: n for name, n in sizes.items() if name not in whole}
    return SdyShardingRule(tuple(operands), tuple(results),
                           need_replication_factors=tuple(replicated), **sizes)


def _shard_origin(mesh, spec, local_shape):
    """uint32 ``[2]``: where this device's shard of x2 (partitioned by ``spec``) starts."""
    origin = []
    for entry, n in zip(spec, local_shape):
        names = _entry_names(entry)
        index = lax.axis_index(names) if names else 0
        origin.append(jnp.asarray(index, jnp.uint32) * jnp.uint32(n))
    return jnp.stack(origin)


def _codec_partition(directions, codec, interpret, bf16_values, launch, has, mesh,
                     arg_shapes, result_shape):
    from jax.sharding import NamedSharding, PartitionSpec

    x = arg_shapes[0]
    if not hasattr(x.sharding, "spec"):  # no mesh to name the axes by: the whole operand
        from mxjax.emulation.in_place import replicated_partition

        def whole(x2, *rest):
            return _codec_flat(x2, _split_extras(rest, has), directions, codec, interpret,
                               bf16_values, launch)

        return replicated_partition(mesh, arg_shapes, result_shape, whole)
    spec = shard_spec(mesh, x.sharding.spec, x.shape, directions, codec.hadamard_size)
    axes = tuple(n for e in spec for n in _entry_names(e))
    replicated = NamedSharding(mesh, PartitionSpec())
    args = [NamedSharding(mesh, PartitionSpec(*spec))] + [replicated] * (len(arg_shapes) - 1)
    results = []
    for d in directions:
        layout = PartitionSpec(*spec) if d == 1 else PartitionSpec(spec[1], spec[0])
        results += [NamedSharding(mesh, layout)] * 2 + [replicated]

    def lower(x2, *rest):
        # Stochastic rounding draws at the whole operand's positions: the shard's origin.
        origin = _shard_origin(mesh, spec, x2.shape) if codec.draw_columns else None
        out = _codec_local(x2, _split_extras(rest, has), directions, codec, interpret,
                           bf16_values, launch, origin)
        flat = []
        for codes, scales, stats in out:
            if axes and stats.size:
                stats = lax.pmax(stats, axes)
            flat += [codes, scales, stats]
        return tuple(flat)

    return mesh, lower, tuple(results), tuple(args)


def _codec_flat(x2, extras, directions, codec, interpret, bf16_values, launch):
    out = _codec_local(x2, extras, directions, codec, interpret, bf16_values, launch)
    return tuple(v for triple in out for v in triple)


@functools.cache
def _sharded_codec():
    """The kernel call as one custom_partitioning op (built once, on first use)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    def fn(directions, codec, interpret, bf16_values, launch, has, x2, *rest):
        return _codec_flat(x2, _split_extras(rest, has), directions, codec, interpret,
                           bf16_values, launch)

    sharded = custom_partitioning(fn, static_argnums=(0, 1, 2, 3, 4, 5))
    sharded.def_partition(partition=_codec_partition, sharding_rule=_codec_rule)
    return sharded


def run_codec_sharded(x2, signs, params, *, directions, codec, interpret, bf16_values=False,
                      launch: Launch | None = None, keys=None):
    """`run_codec` cut to x2's sizes, partitionable: under a multi-device sharding of x2 each
    device runs the kernel on its shard (`shard_spec`; stochastic rounding draws at the
    shard's positions in the whole operand) and the statistics are reduced by one max
    across the shards; the same bits as the unsharded kernel.

    Returns per direction ``(codes [F, Kp * code_columns / 32], scale bytes [F, Kp *
    scale_columns / 32], stats)``, F and K x2's sizes (Kp: K padded to 32).
    """
    launch = _launch_or_default(launch, interpret, directions)
    _check_keys(codec, keys)
    from mxjax.emulation.in_place import batchable, partitioned

    if params is not None:
        params = jnp.asarray(params, jnp.float32).reshape(len(directions))
    if keys is not None:
        keys = jnp.asarray(keys, jnp.uint32).reshape(2 * len(directions))
    extras = (signs, params, keys)
    static = (tuple(directions), codec, interpret, bf16_values, launch)
    if not partitioned():
        return _codec_local(x2, extras, *static)
    has = tuple(v is not None for v in extras)
    rest = [v for v in extras if v is not None]

    def plain(x2, *rest):
        return _codec_flat(x2, _split_extras(rest, has), *static)

    flat = batchable(lambda *args: _sharded_codec()(*static, has, *args), plain)(x2, *rest)
    return [tuple(flat[3 * i:3 * i + 3]) for i in range(len(directions))]


def _quantize(x2, signs, *, directions, op, hadamard_size, interpret, bf16_values=False,
              e2m1_cvt=False, launch=None):
    """MXFP4 per direction: (codes, scale bytes, s_max, s_min), laid out [F, K] (x2's sizes:
    the kernel runs per shard of a sharded x2, `run_codec_sharded`)."""
    codec = Mxfp4Codec(op=op, hadamard_size=hadamard_size, e2m1_cvt=e2m1_cvt)
    out = run_codec_sharded(x2, signs, None, directions=directions, codec=codec,
                            interpret=interpret, bf16_values=bf16_values, launch=launch)
    return [(codes, scales, stats[0], -stats[1]) for codes, scales, stats in out]


def signs_array(signs, hadamard_size):
    """The rotation's signs as the kernel's f32 ``[h]`` input, or None."""
    if signs is None or hadamard_size is None:
        return None
    return jnp.asarray(signs, jnp.float32).reshape(hadamard_size)


def _trimmed(result, f: int, k: int):
    codes, scales, s_max, s_min = result
    return codes[:f, :k // 2], scales[:f, :k // _NV], s_max, s_min


def mxfp4_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                  bf16_values: bool = False, e2m1_cvt: bool = False, interpret: bool = False,
                  launch: Launch | None = None):
    """One MXFP4 operand in one read: codes and scales laid out ``[F, K]`` for the MMA.

    Args:
      x2: bf16 or f32 ``[F, K]`` (axis 1) or ``[K, F]`` (axis 0); K a multiple of 32
        and of the Hadamard size (zero-padded by the caller).
      axis: the contraction axis of x2 (0 or 1).
      op: the OperandRecipe (`takes_kernel`).
      hadamard_size: 16, 32 or None; signs: its ±1 vector (f32 [h]) or None.
      bf16_values: quantize ``x2.astype(bfloat16)`` (an f32 x2 rounded in the kernel,
        not materialized: the GEMM's operand cast).
      e2m1_cvt: convert to E2M1 by PTX's ``cvt.rn.satfinite.e2m1x2.f32`` (Blackwell:
        `has_e2m1_cvt`), the same codes in fewer instructions; not with ``interpret``.
      interpret: run in the Pallas interpreter (CPU tests).
      launch: the kernel's tiles and launch (`run_codec`); the same bits under any.
    Returns:
      ``(codes, scale_bytes, s_max, s_min)``: uint8 ``[F, K // 2]`` (element 2p in the
      low nibble of byte p), uint8 ``[F, K // 16]`` (each 32-block's E8M0 byte,
      2^(byte - 127) or 0xFF for a non-finite block, written for both of its 16-halves),
      and int32 scalars: the largest and smallest scale exponent of a live block
      (nonzero amax, finite), ``s_max`` = `NONFINITE_SENTINEL` when a block is
      non-finite; with no live block ``s_max < s_min``.
    """
    if axis not in (0, 1):
        raise ValueError(f"axis: expected 0 or 1, got {axis!r}")
    _check(x2, op, hadamard_size, e2m1_cvt, interpret)
    check_contraction(x2.shape[axis], hadamard_size)
    (out,) = _quantize(x2, signs_array(signs, hadamard_size), directions=(axis,), op=op,
                       hadamard_size=hadamard_size, interpret=interpret,
                       bf16_values=bf16_values, e2m1_cvt=e2m1_cvt, launch=launch)
    return _trimmed(out, x2.shape[1 - axis], x2.shape[axis])


def mxfp4_operand_pair(x2: jax.Array, op, *, hadamard_size: int | None, signs,
                       bf16_values: bool = False, e2m1_cvt: bool = False,
                       interpret: bool = False, launch: Launch | None = None):
    """Both of x2's MXFP4 operands from one read: blocks along its rows and along its
    columns (the backward's two copies of an operand).

    Args:
      x2: bf16 or f32 ``[R, C]``, R and C multiples of 32 and of the Hadamard size.
      op, hadamard_size, signs, bf16_values, e2m1_cvt, interpret, launch: as for
        `mxfp4_operand`.
    Returns:
      ``(along_rows, along_columns)``: `mxfp4_operand`'s result for axis 1 (codes
      ``[R, C // 2]``) and for axis 0 (codes ``[C, R // 2]``), bit for bit.
    """
    _check(x2, op, hadamard_size, e2m1_cvt, interpret)
    for k in x2.shape:
        check_contraction(k, hadamard_size)
    row, col = _quantize(x2, signs_array(signs, hadamard_size), directions=(1, 0), op=op,
                         hadamard_size=hadamard_size, interpret=interpret,
                         bf16_values=bf16_values, e2m1_cvt=e2m1_cvt, launch=launch)
    r, c = x2.shape
    return _trimmed(row, r, c), _trimmed(col, c, r)


def check_contraction(k: int, hadamard_size):
    """Refuses a contraction that is not a whole number of 32-groups and Hadamard blocks."""
    if k % _MX or (hadamard_size and k % hadamard_size):
        raise ValueError(f"x2: contraction length {k} is not a multiple of 32 and of the "
                         f"Hadamard size {hadamard_size} (pad first)")
