"""attention_impl='fused' compiled without a device (attention as users train it).

A Llama decoder layer's train step (loss and gradients w.r.t. its parameters and input,
``bench/export_shape.layer_train_step``, no policy, bf16 compute, fp32 parameters):

* H200 and B200: cuDNN flash attention, forward and backward (``__cudnn$fmhaSoftmax``,
  ``__cudnn$fmhaSoftmaxBackward``), in a small layer and in the Llama 3.1-8B layer at
  sequence 8192, micro-batch 1, whose temp memory is at most 1.5 GB (the explicit
  form's is printed beside it: 21.6 GB on H200 when this was written);
* v5e: Pallas splash attention's three Mosaic kernels (forward, dq, dk/dv);
* a float32 layer does not lower for cuda (cuDNN takes bf16/fp16), naming the setting;
* the whole model with scanned layers and remat (as the MLPerf config runs it) on H200.

The explicit form of the same small layer is compiled too: it has none of these calls,
so the assertions can fail. Needs cuDNN in the venv (the ``aot-gpu`` extra).
"""

from __future__ import annotations

import functools
import re

import pytest

from bench.costmodel import aot
from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators

FMHA_FWD = '"__cudnn$fmhaSoftmax"'
FMHA_BWD = '"__cudnn$fmhaSoftmaxBackward"'
TEMP_BOUND_8B = 1.5e9  # bytes: the target for the 8B layer at seq 8192 on H200


def _config(size: str, impl: str, dtype: str = "bfloat16"):
    from models.llama import LlamaConfig

    if size == "8b":
        return LlamaConfig.llama3_8b(n_layers=1, dtype=dtype, param_dtype="float32",
                                     attention_impl=impl), 8192
    return LlamaConfig.tiny(vocab_size=256, dim=256, n_layers=1, n_heads=8, n_kv_heads=2,
                            ffn_dim=512, dtype=dtype, param_dtype="float32",
                            attention_impl=impl), 256


@functools.cache
def _compiled(target: str, size: str, impl: str, dtype: str = "bfloat16"):
    """(optimized HLO text, temp bytes) of the layer's train step compiled for `target`."""
    from bench.costmodel import export_shape

    config, seq = _config(size, impl, dtype)
    fn, args = export_shape.layer_train_step(config, None, 1, seq)
    compiled = aot.compile_for(fn, args, require(target))
    return compiled.as_text(), int(compiled.memory_analysis().temp_size_in_bytes)


def _calls(text: str, target: str) -> int:
    return len(re.findall(rf'custom_call_target={re.escape(target)}', text))


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_small_layer_train_step_runs_cudnn_flash_attention(target):
    fused, _ = _compiled(target, "small", "fused")
    assert _calls(fused, FMHA_FWD) == 1 and _calls(fused, FMHA_BWD) == 1
    explicit, _ = _compiled(target, "small", "explicit")
    assert _calls(explicit, FMHA_FWD) == 0 and _calls(explicit, FMHA_BWD) == 0


def test_v5e_small_layer_train_step_runs_splash_attention():
    fused, _ = _compiled("v5e", "small", "fused")
    assert _calls(fused, '"tpu_custom_call"') == 3  # forward, dq, dk/dv
    assert "splash" in fused
    explicit, _ = _compiled("v5e", "small", "explicit")
    assert _calls(explicit, '"tpu_custom_call"') == 0


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_8b_layer_at_seq_8192_fused_attention_and_temp_memory(target):
    fused, temp = _compiled(target, "8b", "fused")
    assert _calls(fused, FMHA_FWD) == 1 and _calls(fused, FMHA_BWD) == 1
    _, temp_explicit = _compiled(target, "8b", "explicit")
    print(f"{target} Llama 3.1-8B layer train step, seq 8192, micro-batch 1: temp memory "
          f"fused {temp / 1e9:.3f} GB, explicit {temp_explicit / 1e9:.3f} GB")
    assert temp <= TEMP_BOUND_8B, temp
    assert 10 * temp < temp_explicit, (temp, temp_explicit)


def test_float32_layer_does_not_lower_for_cuda():
    with pytest.raises(ValueError, match=r"attention_impl='fused' cannot be compiled for "
                                         r"'cuda'.*fp16/bf16"):
        _compiled("h200", "small", "fused", "float32")


def test_h200_whole_model_with_scan_and_remat_runs_cudnn_flash_attention():
    # As configs/llama3_8b_mlperf.yaml runs it (scanned layers, remat), at a small size:
    # the forward kernel also recomputes in the backward pass; one backward kernel.
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.llama import Llama

    config, seq = _config("small", "fused")
    config = config.replace(n_layers=2, scan_layers=True, remat=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))

    def step(state, tokens):
        def loss(state):
            logits = nnx.merge(graphdef, state)(tokens)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
                logits, tokens[..., None], -1)[..., 0])

        return jax.value_and_grad(loss)(state)

    tokens = jax.ShapeDtypeStruct((2, seq), jnp.int32)
    text = aot.compile_for(step, (state, tokens), require("h200")).as_text()
    assert _calls(text, FMHA_FWD) >= 1 and _calls(text, FMHA_BWD) == 1
