"""mxjax.quantize against the independent numpy reference (tests/reference.py).

Bit-exact checks compare uint8 codes/scales exactly and float outputs by their bit
patterns (so -0 and Inf are checked; NaN payload/sign is not part of the contract
and is canonicalised). Codes inside a NaN block (or a NaN per-tensor-scaled
tensor) are not specified by docs/NUMERICS.md and are masked.

Compile budget: one jit per (format, scale rule, rounding) on all adversarial case
tensors in one (rotating) dtype; axis positions, sizes and stochastic rounding get
one jit per format. The full dtype x axis product per combo is marked slow. About a
minute of CPU time for the default selection.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mxjax
from tests import reference as ref

# ----------------------------------------------------------------------------- parameters

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
DT_NAMES = tuple(DTYPES)
# (log2 of the smallest subnormal, log2 of the smallest normal, largest exponent, mantissa bits)
DT_RANGE = {"f32": (-149, -126, 127, 23), "bf16": (-133, -126, 127, 7), "f16": (-24, -14, 15, 10)}
E8M0_FMTS = (mxjax.MXFP4, mxjax.MXFP8_E4M3, mxjax.MXFP8_E5M2)
OTHER_FMTS = (mxjax.NVFP4, mxjax.FP8_E4M3, mxjax.FP8_E5M2)
ALL_FMTS = E8M0_FMTS + OTHER_FMTS
DET = (mxjax.Rounding.NEAREST_EVEN, mxjax.Rounding.TOWARD_ZERO, mxjax.Rounding.NEAREST_AWAY)
RULES = tuple(mxjax.ScaleRule)
COMBOS = [(f, r, d) for f in E8M0_FMTS for r in RULES for d in DET] + [
    (f, mxjax.ScaleRule.FLOOR, d) for f in OTHER_FMTS for d in DET
]
# first, middle, last, negative (middle counted from the end)
AXES = (("first", 0), ("middle", 1), ("last", 2), ("negative", -2))
CASE_SHAPE = (4, 128)  # one "case" tensor: 16 MX blocks / 32 NVFP4 blocks
AXIS_LEN = 40  # not a multiple of any block: exercises padding on every axis


def _combo_id(c):
    f, r, d = c
    return f"{f.name}-{r.value}-{d.value}"


# ----------------------------------------------------------------------------- inputs


def _exact_in(vals: np.ndarray, dt: str) -> np.ndarray:
    """Cast float64 values to dt; values that are not exact there become 0."""
    cast = vals.astype(DTYPES[dt])
    ok = cast.astype(np.float64) == vals
    return np.where(ok | np.isnan(vals), vals, 0.0)


def _grid(elem: ref.Elem) -> np.ndarray:
    """Positive finite grid values of an element format, ascending."""
    v = ref.decode(np.arange(1 << (elem.ebits + elem.mbits)), elem)
    return np.unique(v[np.isfinite(v)])


def _midpoints(elem: ref.Elem, top: float) -> np.ndarray:
    g = _grid(elem)
    g = g[g <= top]
    return (g[:-1] + g[1:]) / 2


def _tie_block(rng, rf: ref.Fmt, n: int, dt: str) -> np.ndarray:
    """A block whose amax pins the scale to 2^k and whose other values are exact ties."""
    e = rf.elem
    lo, _, hi, _ = DT_RANGE[dt]
    k = int(rng.integers(max(-100, lo + 20 - e.emax), min(100, hi - e.emax) + 1))
    mids = rng.choice(_midpoints(e, 2.0**e.emax), size=n - 1)
    blk = np.concatenate([[2.0**e.emax], mids]) * rng.choice([-1.0, 1.0], size=n)
    rng.shuffle(blk)
    return _exact_in(np.ldexp(blk, k), dt)


def _ties_case(rng, rf: ref.Fmt, dt: str) -> np.ndarray:
    rows, cols = CASE_SHAPE
    e = rf.elem
    if rf.block is None:  # per tensor: amax = max_normal makes the tensor scale 1
        mids = _midpoints(e, e.max_normal)
        if dt == "f16":
            mids = mids[mids <= 65504]
        x = rng.choice(mids, size=CASE_SHAPE) * rng.choice([-1.0, 1.0], size=CASE_SHAPE)
        x[0, 0] = e.max_normal
        return _exact_in(x, dt)
    if rf.scale == "e4m3":  # NVFP4: tensor amax 2688 -> tensor scale 1; block amax 6·2^j
        mids = _midpoints(e, 4.0)
        x = np.zeros(CASE_SHAPE)
        for r in range(rows):
            for b in range(cols // 16):
                j = 8 if (r, b) == (0, 0) else int(rng.integers(-6, 9))
                blk = np.concatenate([[6.0], rng.choice(mids, size=15)])
                blk = blk * rng.choice([-1.0, 1.0], size=16) * 2.0**j
                rng.shuffle(blk)
                x[r, 16 * b:16 * b + 16] = blk
        x[0, 0] = 2688.0
        return _exact_in(x, dt)
    blocks = [_tie_block(rng, rf, rf.block, dt) for _ in range(rows * cols // rf.block)]
    return np.concatenate(blocks).reshape(CASE_SHAPE)


def _mantissa_case(rng, dt: str, block: int) -> np.ndarray:
    """Blocks whose amax mantissa sits on/next to every scale-rule threshold."""
    u = 2.0 ** -DT_RANGE[dt][3]
    ms = [1, 1 + u, 1.25, 1.5 - u, 1.5, 1.5 + u, 1.75 - u, 1.75, 1.75 + u, 1.875 - u, 1.875,
          1.9375 - u, 1.9375, 2 - u, 1.75, 1.5]
    span = 8 if dt == "f16" else 40
    x = rng.uniform(-0.99, 0.99, size=CASE_SHAPE)
    flat = x.reshape(-1, block)
    for i in range(flat.shape[0]):
        m = ms[i % len(ms)]
        k = int(rng.integers(-span, span + 1))
        flat[i] *= m * 2.0**k
        flat[i, rng.integers(block)] = rng.choice([-1.0, 1.0]) * m * 2.0**k
        flat[i, rng.integers(block)] = 0.5 * m * 2.0**k  # an exact half of amax
    return flat.reshape(CASE_SHAPE)


def _subnormal_case(rng, dt: str) -> np.ndarray:
    lo, mn, _, _ = DT_RANGE[dt]
    x = np.zeros(CASE_SHAPE)
    nsub = 2 ** (mn - lo)  # number of subnormal steps
    sub = lambda size: rng.integers(1, nsub, size=size) * 2.0**lo * rng.choice([-1, 1], size)
    x[0] = sub(CASE_SHAPE[1])  # whole row subnormal
    x[1] = sub(CASE_SHAPE[1])
    x[1, ::32] = 2.0**mn * rng.uniform(1, 1.99, size=CASE_SHAPE[1] // 32)  # tiny normal amax
    x[1, 5::16] = 2.0 ** (mn + 3)
    x[2] = rng.integers(1, max(2, nsub // 16), size=CASE_SHAPE[1]) * 2.0**lo  # amax ~ 2^(mn-4)
    x[3] = rng.normal(size=CASE_SHAPE[1])
    x[3, 1::3] = sub(len(x[3, 1::3]))  # subnormals next to O(1) values
    return x


def _zeros_case(rng) -> np.ndarray:
    x = np.zeros(CASE_SHAPE)
    x[1] = -0.0
    x[2] = rng.normal(size=CASE_SHAPE[1]) * (rng.uniform(size=CASE_SHAPE[1]) < 0.3)
    x[2, rng.uniform(size=CASE_SHAPE[1]) < 0.3] = -0.0
    x[3, :64] = -0.0
    x[3, 40] = -3.0
    x[3, 64:] = 0.0
    x[3, 100] = 0.75
    return x


def _nonfinite_case(rng) -> np.ndarray:
    x = rng.normal(size=CASE_SHAPE)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 70] = -np.inf
    x[3, 1] = np.nan
    x[3, 7] = np.inf
    x[3, 64:96] = -0.0
    return x


def _extremes_case(rng, dt: str) -> np.ndarray:
    lo, mn, hi, mb = DT_RANGE[dt]
    top = float(np.finfo(DTYPES[dt]).max) if dt != "bf16" else float(ml_dtypes.finfo(
        ml_dtypes.bfloat16).max)
    x = rng.uniform(-1, 1, size=CASE_SHAPE)
    x[0] *= top
    x[0, 0] = top
    x[1] *= 2.0**hi * 1.9
    x[1, 17] = -(2.0**hi) * (2 - 2.0**-mb)
    x[2] = 0.0
    x[2, ::16] = 2.0**mn  # smallest normal, alone
    x[3, :] = 2.0**lo  # smallest subnormal ...
    x[3, ::32] = top  # ... next to the largest finite value
    return x


def _lognormal_case(rng, dt: str) -> np.ndarray:
    if dt == "f16":
        scale = 10.0 ** rng.uniform(-3, 3, size=(CASE_SHAPE[0], 1))
        v = np.exp(rng.normal(0, 1.5, size=CASE_SHAPE)) * scale
        v = np.clip(v, 2.0**-24, 6e4)
    else:  # exponents spanning 1e-30 .. 1e30 (and beyond, inside a row)
        scale = 10.0 ** rng.uniform(-30, 30, size=(CASE_SHAPE[0], 1))
        v = np.exp(rng.normal(0, 3.0, size=CASE_SHAPE)) * scale
    return v * rng.choice([-1.0, 1.0], size=CASE_SHAPE)


@functools.cache
def _cases(fmt_name: str, dt: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """All case tensors for a format and dtype, stacked: (n_cases, *CASE_SHAPE)."""
    rf = ref.FORMATS[fmt_name]
    rng = np.random.default_rng([zlib.crc32(fmt_name.encode()), DT_NAMES.index(dt)])
    cases = {
        "normal": rng.normal(size=CASE_SHAPE) * 2.0 ** rng.integers(-3, 4, size=(4, 1)),
        "lognormal": _lognormal_case(rng, dt),
        "ties": _ties_case(rng, rf, dt),
        "mantissa": _mantissa_case(rng, dt, rf.block or 32),
        "zeros": _zeros_case(rng),
        "subnormal": _subnormal_case(rng, dt),
        "nonfinite": _nonfinite_case(rng),
        "extremes": _extremes_case(rng, dt),
    }
    x = np.stack(list(cases.values())).astype(DTYPES[dt])
    return x, tuple(cases)


@functools.cache
def _axis_input(fmt_name: str, dt: str, axis: int) -> np.ndarray:
    """A finite mixed tensor of base shape (3, 5, AXIS_LEN) with the block axis at `axis`."""
    rf = ref.FORMATS[fmt_name]
    rng = np.random.default_rng([zlib.crc32(fmt_name.encode()), 7, DT_NAMES.index(dt), axis % 3])
    rows = rng.normal(size=(15, AXIS_LEN)) * 2.0 ** rng.integers(-5, 6, size=(15, 1))
    ties = _ties_case(rng, rf, dt).reshape(-1)
    rows[0, :32] = ties[:32]
    rows[1] = _mantissa_case(rng, dt, 32)[0, :AXIS_LEN]
    rows[2, ::3] = -0.0
    rows[3, :] = 0.0
    rows[4] = _subnormal_case(rng, dt)[1, :AXIS_LEN]
    x = rows.reshape(3, 5, AXIS_LEN).astype(DTYPES[dt])
    return np.moveaxis(x, -1, axis)


# ----------------------------------------------------------------------------- comparison


def _unit(x, fmt, axis, **kw):
    """quantize, dequantize (f32 and x.dtype) and fake_quantize of one tensor."""
    q = mxjax.quantize(x, fmt, axis, **kw)
    return {
        "q": q,
        "deq32": mxjax.dequantize(q),
        "deqdt": mxjax.dequantize(q, x.dtype),
        "fake": mxjax.fake_quantize(x, fmt, axis, **kw),
    }


@functools.cache
def _quantize_fn(fmt, axis=-1):
    return jax.jit(lambda x: mxjax.quantize(x, fmt, axis))


_dequantize_jit = jax.jit(mxjax.dequantize, static_argnums=1)


def _masked_codes(codes: np.ndarray, rq: ref.RefQ) -> np.ndarray:
    """Codes with the contract-unspecified ones (NaN blocks/tensors) zeroed."""
    mask = rq.nan_elems
    if rq.fmt.packed:
        mask = mask[..., 0::2]
    mask = np.moveaxis(mask, -1, rq.axis)
    return np.where(mask, 0, np.asarray(codes)).astype(np.uint8)


def _scale_view(scales, rq: ref.RefQ):
    if scales is None:
        return None
    s = np.asarray(scales)
    if rq.fmt.scale == "e4m3" and not np.isfinite(rq.tensor_scale):
        # The whole tensor is NaN through the tensor scale; the E4M3 block-scale
        # bytes of a NaN tensor are not pinned down by the contract.
        return np.zeros_like(s)
    return s


def _repro(x, axis, want, got, label) -> str:
    """A minimal-ish repro string: first differing element and its block."""
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        return f"{label}: shape {got.shape} != expected {want.shape}"
    diff = np.argwhere(ref.float_bits(want) != ref.float_bits(got)) if want.dtype.kind == "f" \
        else np.argwhere(want != got)
    if not len(diff):
        return label
    idx = tuple(diff[0])
    xm = np.moveaxis(np.asarray(x), axis, -1)
    if want.shape == np.shape(x):
        pos = list(idx)
        p = pos.pop(axis % np.ndim(x))
        b0 = p - p % 32
        blk = xm[tuple(pos)][b0:b0 + 32]
        return (f"{label}: first mismatch at {idx}: x={np.asarray(x)[idx]!r} "
                f"expected {want[idx]!r} got {got[idx]!r}; elements [{b0}:{b0 + 32}] along axis="
                f"{axis}: {blk.astype(np.float32).tolist()}; tensor amax="
                f"{np.nanmax(np.abs(np.asarray(x, np.float32)))!r}")
    return f"{label}: first mismatch at {idx}: expected {want[idx]!r} got {got[idx]!r}"


def _check(x, axis, got: dict, fmt, rule, rnd, label: str, **ref_kw):
    """Bitwise comparison of one _unit output against the reference."""
    x = np.asarray(x)
    rq = ref.quantize(x, fmt.name, axis, rule.value, rnd.value, **ref_kw)
    q = got["q"]
    assert isinstance(q, mxjax.MXArray)
    assert q.shape == x.shape and q.axis == axis % x.ndim and q.fmt == fmt, label
    assert q.codes.dtype == jnp.uint8, label
    want32 = ref.dequantize(rq, np.float32)
    with np.errstate(over="ignore"):  # values rounded up past the f16 maximum become Inf
        wantdt = want32.astype(x.dtype)
    ctx = f"{label} [{fmt.name} {rule.value} {rnd.value} {x.dtype} axis={axis}]"
    tree_got = {
        "codes": _masked_codes(q.codes, rq),
        "scales": _scale_view(q.scales, rq),
        "tensor_scale": None if q.tensor_scale is None else ref.float_bits(
            np.asarray(q.tensor_scale, np.float32)),
    }
    tree_want = {
        "codes": _masked_codes(rq.codes, rq),
        "scales": _scale_view(rq.scales, rq),
        "tensor_scale": None if rq.tensor_scale is None else ref.float_bits(
            np.asarray(rq.tensor_scale, np.float32)),
    }
    for name in ("codes", "scales", "tensor_scale"):
        chex.assert_trees_all_equal(
            tree_got[name], tree_want[name],
            custom_message=f"{name}: {ctx}; dequantized: "
            + _repro(x, axis, want32, np.asarray(got["deq32"]), ""),
        )
    for name, want in (("deq32", want32), ("deqdt", wantdt), ("fake", wantdt)):
        g = np.asarray(got[name])
        chex.assert_trees_all_equal(
            ref.float_bits(g), ref.float_bits(want),
            custom_message=f"{name}: " + _repro(x, axis, want, g, ctx),
        )


def _index(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


# ----------------------------------------------------------------------------- bit exact


def _main_unit(fmt, **kw):
    unit = functools.partial(_unit, fmt=fmt, axis=-1, **kw)
    # per-tensor scales (FP8, NVFP4): every case must be its own tensor
    return unit if fmt.scale == "e8m0" else jax.vmap(unit)


def _check_cases(x, names, got, fmt, rule, rnd):
    if fmt.scale == "e8m0":  # blocks are independent: all cases in one tensor
        _check(x, -1, got, fmt, rule, rnd, "cases")
    else:
        for c, name in enumerate(names):
            _check(x[c], -1, _index(got, c), fmt, rule, rnd, f"case {name}")


@functools.cache
def _cases_fn(fmt, rule, rnd, n_dtypes):
    unit = _main_unit(fmt, scale_rule=rule, rounding=rnd)
    return jax.jit(lambda xs: [unit(x) for x in xs])


def _combo_dtype(combo) -> str:
    fmt, rule, rnd = combo
    r = RULES.index(rule) if fmt.scale == "e8m0" else 0
    return DT_NAMES[(r + DET.index(rnd)) % 3]


@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_bit_exact_against_reference(combo):
    """Every (format, rule, rounding) on all case tensors (axis -1) in one dtype, rotating
    so that every (format, rule, dtype) and (format, rounding, dtype) triple is covered.
    Axis positions: test_axis_positions; the full product: test_bit_exact_full_product."""
    fmt, rule, rnd = combo
    x, names = _cases(fmt.name, _combo_dtype(combo))
    (got,) = _cases_fn(fmt, rule, rnd, 1)((jnp.asarray(x),))
    _check_cases(x, names, got, fmt, rule, rnd)


@functools.cache
def _axes_fn(fmt, settings_):
    def run(xs):
        return [_unit(x, fmt, a, scale_rule=r, rounding=d)
                for x, ((_, a), r, d, _) in zip(xs, settings_)]
    return jax.jit(run)


def _check_axes(fmt, settings_):
    xs = [_axis_input(fmt.name, dt, a) for (_, a), _, _, dt in settings_]
    got = _axes_fn(fmt, settings_)(tuple(jnp.asarray(x) for x in xs))
    for x, g, ((name, a), r, d, _) in zip(xs, got, settings_):
        _check(x, a, g, fmt, r, d, f"axis {name}")


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_axis_positions(fmt):
    """First, middle, last and negative block axis (length 40: padded), one jit per
    format, with the dtype, scale rule and rounding rotating over the four."""
    i = ALL_FMTS.index(fmt)
    rules = RULES if fmt.scale == "e8m0" else (mxjax.ScaleRule.FLOOR,)
    settings_ = tuple(
        (AXES[j], rules[(i + j) % len(rules)], DET[(i + j) % 3], DT_NAMES[(i + 2 * j) % 3])
        for j in range(4))
    _check_axes(fmt, settings_)


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_bit_exact_full_product(combo):
    """The full product: all three dtypes and all four axis positions for every combo."""
    fmt, rule, rnd = combo
    mains = [_cases(fmt.name, dt) for dt in DT_NAMES]
    got = _cases_fn(fmt, rule, rnd, 3)(tuple(jnp.asarray(x) for x, _ in mains))
    for (x, names), g in zip(mains, got):
        _check_cases(x, names, g, fmt, rule, rnd)
    for dt in DT_NAMES:
        _check_axes(fmt, tuple((ax, rule, rnd, dt) for ax in AXES))


SIZE_SHAPES = ((3, 1), (31,), (2, 33, 2), (4097,))
SIZE_AXES = (-1, 0, 1, -1)


@functools.cache
def _sizes_fn(fmt, rule, rnd):
    kw = {"scale_rule": rule, "rounding": rnd}
    return jax.jit(lambda xs: [_unit(x, fmt, a, **kw) for x, a in zip(xs, SIZE_AXES)])


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_sizes_along_block_axis(fmt, np_rng):
    """Block-axis lengths 1, 31, 33, 4097 (zero padding inside quantize)."""
    i = ALL_FMTS.index(fmt)
    rule = RULES[i % 4] if fmt.scale == "e8m0" else mxjax.ScaleRule.FLOOR
    rnd = DET[i % 3]
    xs = []
    for shape in SIZE_SHAPES:
        x = np_rng.normal(size=shape) * 2.0 ** np_rng.integers(-8, 8, size=shape)
        x.reshape(-1)[::7] = -0.0
        x.reshape(-1)[3::11] = 2.0**-140
        xs.append(x.astype(np.float32))
    got = _sizes_fn(fmt, rule, rnd)(tuple(jnp.asarray(x) for x in xs))
    for x, a, g in zip(xs, SIZE_AXES, got):
        n = x.shape[a]
        if fmt.is_block:
            padded = -(-n // fmt.block_size) * fmt.block_size
            per_byte = 2 if fmt.packed else 1
            assert g["q"].codes.shape[a] == padded // per_byte
            assert g["q"].scales.shape[a] == padded // fmt.block_size
        _check(x, a, g, fmt, rule, rnd, f"size {n}")


# ----------------------------------------------------------------------------- properties


@functools.cache
def _single_fn(fmt, rule, rnd, axis):
    kw = {"scale_rule": rule, "rounding": rnd}
    return jax.jit(lambda x: _unit(x, fmt, axis, **kw))


_any_f32 = hnp.arrays(
    np.float32, (2, 48),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_any_f32, which=st.sampled_from([
    (mxjax.MXFP4, mxjax.ScaleRule.EVEN, mxjax.Rounding.NEAREST_EVEN),
    (mxjax.MXFP8_E4M3, mxjax.ScaleRule.RCEIL, mxjax.Rounding.NEAREST_EVEN),
    (mxjax.NVFP4, mxjax.ScaleRule.FLOOR, mxjax.Rounding.NEAREST_EVEN),
    (mxjax.FP8_E5M2, mxjax.ScaleRule.FLOOR, mxjax.Rounding.NEAREST_EVEN),
]))
def test_arbitrary_f32_against_reference(x, which):
    """Hypothesis: any f32 values (subnormals, Inf, NaN, huge) match the reference."""
    fmt, rule, rnd = which
    _check(x, 0, _single_fn(fmt, rule, rnd, 0)(jnp.asarray(x)), fmt, rule, rnd, "hypothesis")


@pytest.mark.parametrize("fmt", [mxjax.MXFP4, mxjax.MXFP8_E4M3, mxjax.MXFP8_E5M2,
                                 mxjax.FP8_E4M3, mxjax.FP8_E5M2, mxjax.NVFP4],
                         ids=lambda f: f.name)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_nearest_even_matches_ml_dtypes(fmt, data):
    """With the total scale pinned to 1, RNE codes equal ml_dtypes' RNE casts."""
    rf = ref.FORMATS[fmt.name]
    e = rf.elem
    mx = float(e.max_normal)
    v = data.draw(hnp.arrays(np.float32, (64,), elements=st.floats(
        -mx, mx, width=32, allow_subnormal=True)))
    v = v.copy()
    if fmt.scale == "e8m0":
        v[0], v[32] = 2.0**e.emax, -mx  # block amax in [2^emax, max_normal]: s = 0 (FLOOR)
    elif fmt.scale == "e4m3":
        v = np.clip(v, -6, 6).astype(np.float32)
        v[::16] = 6.0  # block scale 1 ...
        v = np.concatenate([v, np.float32([2688.0] + [0.0] * 15)])  # ... tensor scale 1
    else:
        v[0] = mx  # tensor scale 1
    dt = ref.ml_dtype_of(e)
    q = _single_fn(fmt, mxjax.ScaleRule.FLOOR, mxjax.Rounding.NEAREST_EVEN, 0)(jnp.asarray(v))["q"]
    codes = np.asarray(q.codes)
    if rf.packed:
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(-1)
    want = v.astype(dt).view(np.uint8)
    if fmt.scale == "e4m3":
        codes, want = codes[:64], want[:64]
    chex.assert_trees_all_equal(codes[: len(want)], want)


def test_reference_rounding_self_consistent(np_rng):
    """The vectorised float64 rounding of the reference equals exact fractions."""
    from fractions import Fraction

    for elem in (ref.E2M1, ref.E4M3, ref.E5M2):
        # values around the grid, ties included, both signs
        y = np.concatenate([
            np_rng.normal(size=200) * elem.max_normal / 3,
            _midpoints(elem, elem.max_normal) * np_rng.choice([-1.0, 1.0], size=1),
            np.ldexp(np_rng.uniform(1, 2, 50), np_rng.integers(elem.emin - 6, elem.emax + 3, 50)),
        ]).astype(np.float32).astype(np.float64)
        u = np_rng.uniform(size=y.shape).astype(np.float32)
        for rnd in ("nearest_even", "nearest_away", "toward_zero", "stochastic"):
            got = ref.round_to_grid(y, elem, rnd, u)
            for yi, ui, gi in zip(y, u, got):
                neg, mag = ref.round_scalar_exact(Fraction(float(yi)), yi < 0, elem, rnd,
                                                  Fraction(float(ui)))
                want = -mag if neg else mag
                assert Fraction(float(gi)) == want, (elem.name, rnd, yi, gi, want)
                assert np.signbit(gi) == np.signbit(yi), (elem.name, rnd, yi, gi)


# ----------------------------------------------------------------------------- stochastic


@functools.cache
def _sr_fn(fmt, axis):
    def run(x, key):
        outs = []
        for pre in (False, True):
            kw = {"rounding": mxjax.Rounding.STOCHASTIC, "key": key, "sr_prescale": pre}
            outs.append(_unit(x, fmt, axis, **kw))
        return outs
    return jax.jit(run)


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_stochastic_bit_exact(fmt, np_rng):
    """SR with the contract's uniforms (drawn on the moved+padded shape) matches the reference,
    with and without the 3/4 pre-scale."""
    x = (np_rng.normal(size=(3, 40, 5)) * 2.0 ** np_rng.integers(-6, 6, size=(3, 1, 5)))
    x = x.astype(np.float32)
    key = jax.random.key(int(np_rng.integers(1 << 30)))
    axis = 1
    u = np.asarray(jax.random.uniform(key, ref.moved_padded_shape(x.shape, fmt.name, axis),
                                      jnp.float32))
    for pre, got in zip((False, True), _sr_fn(fmt, axis)(jnp.asarray(x), key)):
        assert got["q"].sr_prescale == pre
        _check(x, axis, got, fmt, mxjax.ScaleRule.FLOOR, mxjax.Rounding.STOCHASTIC,
               f"SR prescale={pre}", u=u, sr_prescale=pre)


N_DRAWS = 4096


@functools.cache
def _sr_many(fmt):
    return jax.jit(lambda x, key: mxjax.fake_quantize(
        x, fmt, -1, rounding=mxjax.Rounding.STOCHASTIC, key=key))


@pytest.mark.parametrize("fmt", [mxjax.MXFP4, mxjax.MXFP8_E5M2], ids=lambda f: f.name)
def test_stochastic_neighbours_and_unbiased(fmt, np_rng):
    """Only the two neighbouring grid values appear, and the mean is unbiased.

    Every row is the same block (amax 2^emax pins the scale to 1), so each value is
    rounded N_DRAWS = 4096 times with independent uniforms. A draw is lo + (hi-lo)·B
    with B ~ Bernoulli(p), p = (x-lo)/(hi-lo), so the sample mean has standard
    deviation (hi-lo)·sqrt(p(1-p)/N). We allow 5 such standard deviations (a false
    failure rate ~1e-6 per value, ~1e-4 for the 32x2 values tested), plus the
    discretisation bias of float32 uniforms (multiples of 2^-24 at most, i.e.
    <= 2^-24·(hi-lo)), which is negligible.
    """
    e = ref.FORMATS[fmt.name].elem
    g = _grid(e)
    g = g[g <= 2.0**e.emax]
    block = np_rng.uniform(0, 2.0**e.emax, size=32) * np_rng.choice([-1.0, 1.0], size=32)
    block[0] = 2.0**e.emax
    block[1] = -g[3]  # a grid value: must come back unchanged every time
    block = block.astype(np.float32)
    x = np.tile(block, (N_DRAWS, 1))
    out = np.asarray(_sr_many(fmt)(jnp.asarray(x), jax.random.key(int(np_rng.integers(99)))))
    a = np.abs(block.astype(np.float64))
    idx = np.searchsorted(g, a, side="right") - 1
    lo = np.where(a < g[0], 0.0, g[np.maximum(idx, 0)])
    on_grid = lo == a
    hi = np.where(on_grid, lo, g[np.minimum(idx + 1, len(g) - 1)])
    hi = np.where(a < g[0], g[0], hi)
    sgn = np.sign(block)
    for j in range(32):
        vals = set(np.unique(out[:, j]).tolist())
        allowed = {float(sgn[j] * lo[j]), float(sgn[j] * hi[j])}
        assert vals <= allowed, (j, block[j], vals, allowed)
        if on_grid[j]:
            continue
        p = (a[j] - lo[j]) / (hi[j] - lo[j])
        tol = 5 * (hi[j] - lo[j]) * math.sqrt(p * (1 - p) / N_DRAWS) + 2.0**-24 * (hi[j] - lo[j])
        mean = np.mean(out[:, j].astype(np.float64))
        assert abs(mean - block[j]) <= tol, (j, block[j], mean, tol)


def test_stochastic_keys():
    """Same key -> same result; different keys -> different codes."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)), jnp.float32)
    f = jax.jit(lambda x, k: mxjax.quantize(x, mxjax.MXFP4, rounding="stochastic", key=k).codes)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    chex.assert_trees_all_equal(f(x, k1), f(x, k1))
    assert np.any(np.asarray(f(x, k1)) != np.asarray(f(x, k2)))


def test_sr_prescale_multiplies_by_three_quarters(np_rng):
    """quantize(x, sr_prescale) has the codes of quantize(3/4·x) at the same scale, and
    dequantizes to fp32(4/3) times that."""
    # few mantissa bits so 3/4·x is exact; block amax 5.5 (m = 1.375 >= 4/3) keeps the
    # FLOOR scale of 3/4·x equal to that of x.
    x = np_rng.integers(-5 * 64, 5 * 64, size=(4, 32)) / 64.0
    x[:, 0] = 5.5
    x = x.astype(np.float32)
    x34 = (x * 0.75).astype(np.float32)
    assert np.all(x34.astype(np.float64) == x.astype(np.float64) * 0.75)
    key = jax.random.key(7)
    kw = {"rounding": mxjax.Rounding.STOCHASTIC, "key": key}
    qp, q = jax.jit(lambda a, b: (mxjax.quantize(a, mxjax.MXFP4, sr_prescale=True, **kw),
                                  mxjax.quantize(b, mxjax.MXFP4, **kw)))(x, x34)
    assert qp.sr_prescale and not q.sr_prescale
    chex.assert_trees_all_equal((qp.codes, qp.scales), (q.codes, q.scales))
    want = np.asarray(_dequantize_jit(q, jnp.float32)) * np.float32(4.0 / 3.0)
    chex.assert_trees_all_equal(ref.float_bits(np.asarray(_dequantize_jit(qp, jnp.float32))),
                                ref.float_bits(want))


# ----------------------------------------------------------------------------- layout & pytree


def test_packing_low_nibble_first():
    """Known answer: with scale 1 the E2M1 codes of [1, 6, -0.5, 0, ...] pack as 0x72, 0x09."""
    x = np.zeros(32, np.float32)
    x[:4] = [1.0, 6.0, -0.5, 0.0]
    x[4] = 4.0  # amax 6 -> FLOOR s = 0
    q = _quantize_fn(mxjax.MXFP4)(jnp.asarray(x))
    codes = np.asarray(q.codes)
    assert codes.shape == (16,) and np.asarray(q.scales).tolist() == [127]
    assert codes[0] == (0x2 | 0x7 << 4) and codes[1] == (0x9 | 0x0 << 4) and codes[2] == 0x6


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_grid_values_round_trip(fmt, np_rng):
    """Values already on the grid (times a power-of-two block scale) come back unchanged."""
    rf = ref.FORMATS[fmt.name]
    g = _grid(rf.elem)
    x = np_rng.choice(np.concatenate([g, -g, [0.0]]), size=(6, 64))
    if fmt.scale == "e8m0":
        x[:, ::32] = rf.elem.max_normal  # amax = max_normal -> FLOOR scale 2^k
        x = x * 2.0 ** np_rng.integers(-20, 20, size=(6, 1))
    elif fmt.scale == "e4m3":
        x = np.clip(x, -6, 6)
        x[:, ::16] = 6.0
        x[0, :16] = x[0, :16] * 448.0  # this block's scale is 448 ...
        x[0, 0] = 2688.0  # ... and the tensor scale 1
    else:
        x[0, 0] = rf.elem.max_normal
    x = x.astype(np.float32)
    y = np.asarray(_dequantize_jit(_quantize_fn(fmt, 1)(jnp.asarray(x)), jnp.float32))
    chex.assert_trees_all_equal(ref.float_bits(y), ref.float_bits(x))


def test_mxarray_is_a_pytree():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 64)), jnp.float32)
    for fmt in (mxjax.MXFP4, mxjax.NVFP4, mxjax.FP8_E4M3):
        q = _quantize_fn(fmt, 0)(x)
        leaves, treedef = jax.tree.flatten(q)
        assert len(leaves) == sum(a is not None for a in (q.codes, q.scales, q.tensor_scale))
        q2 = jax.tree.unflatten(treedef, leaves)
        assert isinstance(q2, mxjax.MXArray)
        assert (q2.shape, q2.axis, q2.fmt, q2.sr_prescale) == (q.shape, q.axis, q.fmt, False)
        q3 = jax.tree.map(lambda a: a + 0, q)
        assert isinstance(q3, mxjax.MXArray) and q3.axis == 0
        chex.assert_trees_all_equal(q3.codes, q.codes)
        # through jit, as input and as output
        want = ref.dequantize(ref.quantize(np.asarray(x), fmt.name, 0))
        chex.assert_trees_all_equal(ref.float_bits(np.asarray(_dequantize_jit(q, jnp.float32))),
                                    ref.float_bits(want))
        q4 = jax.jit(lambda q: q)(q)
        assert isinstance(q4, mxjax.MXArray) and q4.fmt == fmt
        chex.assert_trees_all_equal(jax.tree.leaves(q4), jax.tree.leaves(q))
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.axis = 1


@pytest.mark.parametrize("fmt, want", [
    (mxjax.MXFP4, jnp.float4_e2m1fn), (mxjax.NVFP4, jnp.float4_e2m1fn),
    (mxjax.MXFP8_E4M3, jnp.float8_e4m3fn), (mxjax.FP8_E4M3, jnp.float8_e4m3fn),
    (mxjax.MXFP8_E5M2, jnp.float8_e5m2), (mxjax.FP8_E5M2, jnp.float8_e5m2),
])
def test_dtype_is_the_element_dtype_and_fmt_the_format(fmt, want):
    q = jax.eval_shape(lambda x: mxjax.quantize(x, fmt), jnp.ones((2, 32), jnp.float32))
    assert q.dtype == jnp.dtype(want)
    assert isinstance(q.dtype, np.dtype)
    assert q.fmt is fmt


@pytest.mark.parametrize(
    "fmt,shape,axis,bits_per_element",
    [
        (mxjax.MXFP4, (8, 64), -1, 4.25),
        (mxjax.MXFP4, (64, 8), 0, 4.25),
        (mxjax.MXFP8_E4M3, (8, 64), -1, 8.25),
        (mxjax.MXFP8_E5M2, (8, 64), 1, 8.25),
        (mxjax.NVFP4, (8, 64), -1, 4.5),
        (mxjax.FP8_E4M3, (8, 64), -1, 8.0),
    ],
)
def test_nbytes(fmt, shape, axis, bits_per_element):
    """nbytes = codes + scales (+ 4 for an fp32 tensor scale); MXFP4 is 4.25 bits/element."""
    q = jax.eval_shape(lambda x: mxjax.quantize(x, fmt, axis), jnp.ones(shape, jnp.float32))
    extra = 4 if fmt.tensor_scale else 0
    assert q.nbytes == math.prod(shape) * bits_per_element / 8 + extra
    assert q.nbytes == sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(q))


def test_nbytes_counts_padding():
    """40 elements along the block axis pad to 64: MXFP4 stores 32 code bytes + 2 scales."""
    q = jax.eval_shape(lambda x: mxjax.quantize(x, mxjax.MXFP4), jnp.ones((3, 40), jnp.float32))
    assert q.codes.shape == (3, 32) and q.scales.shape == (3, 2) and q.shape == (3, 40)
    assert q.nbytes == 3 * (32 + 2)


class JitAgreementTest(chex.TestCase):
    """jit and eager give the same bits (and both match the reference)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_fake_quantize_and_quantize(self):
        rng = np.random.default_rng(3)
        x = rng.normal(size=(5, 40)).astype(np.float32)
        x[0, :8] = 2.0**-140  # subnormals
        x[1, 3] = -0.0
        x = jnp.asarray(x)
        # Eager (op by op) each format costs ~4 s of op compiles. NVFP4 and MXFP4 (below)
        # run eagerly; NVFP4's tensor scale is per-tensor FP8's (mxjax.scaling._tensor_scale)
        # with an E4M3 block scale on top, so FP8 (bit for bit under jit here, and in
        # test_bit_exact_against_reference) adds no eager path of its own.
        fmts = (mxjax.NVFP4,) if self.variant.type == chex.ChexVariantType.WITHOUT_JIT else (
            mxjax.NVFP4, mxjax.FP8_E5M2)
        for fmt in fmts:  # MXFP4 (quantize) is checked below
            fq = self.variant(functools.partial(mxjax.fake_quantize, fmt=fmt, axis=-1))
            want = ref.fake_quantize(np.asarray(x), fmt.name, -1)
            chex.assert_trees_all_equal(ref.float_bits(np.asarray(fq(x))), ref.float_bits(want),
                                        custom_message=fmt.name)
        qz = self.variant(functools.partial(mxjax.quantize, fmt=mxjax.MXFP4, axis=0))
        rq = ref.quantize(np.asarray(x), "mxfp4", 0)
        chex.assert_trees_all_equal((np.asarray(qz(x).codes), np.asarray(qz(x).scales)),
                                    (rq.codes, rq.scales))


@functools.cache
def _vmap_fns(fmt):
    qv = jax.jit(jax.vmap(lambda a: mxjax.quantize(a, fmt, axis=-1)))
    fv = jax.jit(jax.vmap(lambda a: mxjax.fake_quantize(a, fmt, axis=0)))
    q1 = jax.jit(lambda a: mxjax.quantize(a, fmt, axis=-1))
    f1 = jax.jit(lambda a: mxjax.fake_quantize(a, fmt, axis=0))
    return qv, fv, q1, f1


def test_vmap_matches_per_slice():
    """vmap(quantize) over a leading axis equals quantize of each slice (per-slice tensor
    scales for NVFP4/FP8), and vmap over keys works."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 4, 40)) * np.array([1e-3, 1.0, 1e3])[:, None, None],
                    jnp.float32)
    for fmt in (mxjax.MXFP4, mxjax.NVFP4, mxjax.FP8_E4M3):
        qv, fv, q1, f1 = _vmap_fns(fmt)
        if fmt is mxjax.MXFP4:  # blocks are independent: only quantize
            chex.assert_trees_all_equal(jax.tree.leaves(_index(qv(x), 1)),
                                        jax.tree.leaves(q1(x[1])))
            continue
        qb, fb = qv(x), fv(x)
        for i in range(3):
            chex.assert_trees_all_equal(jax.tree.leaves(_index(qb, i)), jax.tree.leaves(q1(x[i])),
                                        custom_message=fmt.name)
            chex.assert_trees_all_equal(ref.float_bits(np.asarray(fb[i])),
                                        ref.float_bits(np.asarray(f1(x[i]))))
    keys = jax.random.split(jax.random.key(0), 3)
    out = jax.jit(jax.vmap(lambda k: mxjax.fake_quantize(x[0], mxjax.MXFP4,
                                                         rounding="stochastic", key=k)))(keys)
    assert out.shape == (3, 4, 40)
    assert np.any(np.asarray(out[0]) != np.asarray(out[1]))


def test_bf16_format_is_passthrough():
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 8)), jnp.bfloat16)
    chex.assert_trees_all_equal(mxjax.fake_quantize(x, mxjax.BF16), x)


# ----------------------------------------------------------------------------- errors


def test_bad_arguments_raise_naming_the_argument():
    x = jnp.ones((4, 32), jnp.float32)
    with pytest.raises(ValueError, match="fmt"):
        mxjax.quantize(x, "mxfp5")
    with pytest.raises(ValueError, match="fmt"):
        mxjax.fake_quantize(x, "not_a_format")
    with pytest.raises(ValueError, match="axis"):
        mxjax.quantize(x, mxjax.MXFP4, axis=2)
    with pytest.raises(ValueError, match="axis"):
        mxjax.fake_quantize(x, mxjax.MXFP4, axis=-3)
    with pytest.raises(TypeError, match="x"):
        mxjax.quantize(jnp.ones((4, 32), jnp.int32), mxjax.MXFP4)
    with pytest.raises(ValueError, match="key"):
        mxjax.quantize(x, mxjax.MXFP4, rounding=mxjax.Rounding.STOCHASTIC)
    with pytest.raises(ValueError, match="key"):
        mxjax.fake_quantize(x, mxjax.NVFP4, rounding="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        mxjax.quantize(x, mxjax.MXFP4, rounding="nearest")
    with pytest.raises(ValueError, match="scale_rule"):
        mxjax.quantize(x, mxjax.MXFP4, scale_rule="round")
