"""The public Hadamard functions accept exactly the documented sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import mxjax
from mxjax.rotation import HADAMARD_SIZES


@pytest.mark.parametrize("h", [1, 2, 4, 8, 12, 48, 256, True])
def test_block_sizes_outside_16_to_128_are_refused(h):
    x = jnp.ones((2, 256), jnp.float32)
    match = r"block_size: must be one of \(16, 32, 64, 128\)"
    with pytest.raises(ValueError, match=match):
        mxjax.hadamard(x, h)
    with pytest.raises(ValueError, match=match):
        mxjax.fixed_signs(0, h)
    with pytest.raises(ValueError, match=match):
        mxjax.random_signs(jax.random.key(0), h)


def test_documented_sizes_are_accepted():
    assert HADAMARD_SIZES == (16, 32, 64, 128)
    x = jnp.ones((2, 128), jnp.float32)
    for h in HADAMARD_SIZES:
        assert mxjax.hadamard(x, h, signs=mxjax.fixed_signs(1, h)).shape == x.shape
