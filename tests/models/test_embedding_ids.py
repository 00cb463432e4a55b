"""Token ids outside the vocabulary: a clear error for concrete ids,
NaN for that sequence (caught by the non-finite guard) under jit; never another row."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from llama_test_utils import small

from models.llama import Llama

CFG = small()
V = CFG.vocab_size


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def fwd():
    return nnx.jit(lambda m, t: m(t))


def _tokens(bad: int) -> jnp.ndarray:
    t = np.arange(16, dtype=np.int32).reshape(2, 8) % V
    t[0, 3] = bad
    return jnp.asarray(t)


@pytest.mark.parametrize("bad", [V, V + 1000, -1, -V])
def test_concrete_out_of_vocab_ids_raise(model, bad):
    with pytest.raises(ValueError, match=rf"tokens: id {bad} at position \(0, 3\) is outside "
                                         rf"the vocabulary \[0, {V}\)"):
        model(_tokens(bad))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.embed(_tokens(bad))


@pytest.mark.parametrize("bad", [V, -1])
def test_traced_out_of_vocab_ids_give_nan_for_that_sequence(model, fwd, bad):
    # The NaN row reaches every position of its sequence (a masked-out attention weight
    # of 0 times a NaN value is NaN), so that sequence's loss is NaN; others are untouched.
    logits = np.asarray(fwd(model, _tokens(bad)))
    assert np.isnan(logits[0, 3:]).all()
    good = np.asarray(fwd(model, _tokens(5)))
    np.testing.assert_array_equal(logits[1], good[1])


def test_traced_out_of_vocab_ids_give_nan_on_the_one_hot_path():
    import mxjax

    cfg = small(quantize_embed_head=True)
    m = Llama(cfg, rngs=nnx.Rngs(0))
    f = nnx.jit(lambda m, t: m(t, policy=mxjax.policies.get("passthrough")))
    logits = np.asarray(f(m, _tokens(-1)))
    assert np.isnan(logits[0, 3:]).all() and np.isfinite(logits[1]).all()
