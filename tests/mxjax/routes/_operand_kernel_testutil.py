"""Helpers shared by the one-pass operand kernels' tests (MXFP4, NVFP4, MXFP8)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from tests.mxjax.kernels._kernel_testutil import hadamard, quantize


def configs(names, default: str) -> list:
    """`names` as pytest params, all but `default` marked slow: the interpreter compiles
    each config's kernel (~10 s on 2 cores), so the default run checks one and
    ``make test-slow`` the others."""
    return [pytest.param(n, marks=() if n == default else pytest.mark.slow)
            for n in sorted(names)]


def signs(h, seed):
    """The fixed ±1 signs of seed `seed` for a Hadamard of size h, or None."""
    return None if seed is None else mxjax.fixed_signs(seed, h)


@functools.cache
def pair_fn(kernel_pair, op, h, seed):
    """The jitted pair kernel `kernel_pair` for (op, h, signs seed), in the interpreter."""
    return jax.jit(functools.partial(kernel_pair, op=op, hadamard_size=h,
                                     signs=signs(h, seed), interpret=True))


def reference(x, op, h, seed, axis, *, rotate_in_dtype=False):
    """mxjax.quantize of the operand rotated along `axis` (in f32, or in its own dtype),
    laid out as the kernels write it: (codes [F, ...], scale bytes [F, ...], tensor scale)."""
    xf = jnp.asarray(x) if rotate_in_dtype else jnp.asarray(x, jnp.float32)
    if h is not None:
        xf = hadamard(xf, h, axis=axis, signs=signs(h, seed))
    q = quantize(xf.astype(jnp.float32), op.fmt, axis=axis, scale_rule=op.scale_rule,
                 rounding=op.rounding)
    codes, scales = np.asarray(q.codes), np.asarray(q.scales)
    if axis == 0:
        codes, scales = codes.T, scales.T
    return codes, scales, None if q.tensor_scale is None else np.asarray(q.tensor_scale)


def check_pair(kernel_pair, x, op, h, seed, assert_same, **reference_kw):
    """Runs the pair kernel on x and checks both directions against `reference` with
    ``assert_same(got, want)``; returns (along rows, along columns)."""
    row, col = pair_fn(kernel_pair, op, h, seed)(x)
    assert_same(row, reference(x, op, h, seed, 1, **reference_kw))
    assert_same(col, reference(x, op, h, seed, 0, **reference_kw))
    return row, col


def assert_refuses_bad_arguments(single, pair, op, sr_op, sr_match="deterministic rounding"):
    """The kernels' one-paragraph errors: a bad axis, a non-2-D operand, stochastic
    rounding (``sr_match``: the error of a kernel that takes it only with a key), a pair
    whose sizes are not whole blocks."""
    import pytest

    x = jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="axis"):
        single(x, 2, op, hadamard_size=None, signs=None)
    with pytest.raises(ValueError, match="x2: expected a 2-D"):
        single(x[None], 1, op, hadamard_size=None, signs=None)
    with pytest.raises(ValueError, match=sr_match):
        single(x, 1, sr_op, hadamard_size=None, signs=None)
    with pytest.raises(ValueError, match="contraction length 40"):
        pair(x[:40], op, hadamard_size=None, signs=None)
