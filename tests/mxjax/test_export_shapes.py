"""What GPUs and TPUs get: the emulated GEMMs' shape in programs exported from this CPU machine.

``jax.export(..., platforms=['cuda'|'tpu'])`` lowers for an accelerator without
one. The forward+backward of ``mxjax.dot_general`` and of one tiny Llama decoder
layer are exported under four presets and their StableHLO is read with
``bench/export_shape.py``'s analyzer. Bounds asserted, per quantized operand
(each GEMM has two):

* the GEMM: bf16 x bf16 -> f32 at DEFAULT precision (per-tensor FP8 on CUDA: f8 x f8
  -> f32), never f32 at HIGHEST;
* amax reductions (reduce-max over the |x| bits): MX formats 1 (block amax),
  NVFP4 2 (tensor amax, block amax), per-tensor FP8 1 (tensor amax). Each is
  one read of the operand; the rest (Hadamard butterflies, rounding, scaling,
  bf16 convert) is elementwise on that read and fuses, so a quantized operand
  costs at most (reductions + 1) passes before the GEMM reads it;
* optimization barriers: MXFP4 on GPUs 1, the input of the rounding pass, so that
  XLA recomputes the rotation there instead of materializing the f32 rotated
  operand between the amax pass and the rounding pass (mxjax/emulation/in_place.py), none
  on TPUs; NVFP4 3 and FP8 2 at most, the value guards of the per-tensor division (a
  traced tensor-scale divisor; the element divisors depend on the operand so that XLA
  cannot rewrite ``x / d`` as ``x * (1/d)``; docs/NUMERICS.md). The CPU-only barriers (every
  second Hadamard stage, per operand, code packing) are absent;
* no ``reverse`` (the butterflies pair halves of bit axes); MXFP4 operands that tile go through
  one TPU kernel each (a ``tpu_custom_call``, its amax inside).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from bench.costmodel import export_shape as es
from models.llama import LlamaConfig
from mxjax import policies

POLICIES = ("mxfp4_all_h16", "mxfp4_all", "nvfp4", "fp8")
PLATFORMS = ("cuda", "tpu")
# Upper bounds per quantized operand and platform (see the module docstring).
# cuda, MXFP4: the rounding pass recomputes the rotation behind a barrier; with H16 a
# second one gives the last butterfly stage's two halves their own copies (split_halves).
BARRIERS_PER_OPERAND = {
    "cuda": {"mxfp4_all_h16": 2, "mxfp4_all": 1, "nvfp4": 3, "fp8": 2},
    "tpu": {"mxfp4_all_h16": 0, "mxfp4_all": 0, "nvfp4": 3, "fp8": 2},
}
AMAX_PER_OPERAND = {"mxfp4_all_h16": 1, "mxfp4_all": 1, "nvfp4": 2, "fp8": 1}
# The quantized dots where they are not bf16 x bf16 -> f32: per-tensor FP8 on CUDA runs
# on FP8 tensor cores (mxjax/emulation/fp8_units.py; tests/mxjax/emulation/test_fp8_units.py).
# fp8 on CUDA: fprop E4M3 x E4M3, dgrad dY x W (E5M2 x E4M3), wgrad X x dY (E4M3 x E5M2:
# its operands swapped so that the result comes out in W's layout, mxjax.gemm).
# fp8's forward GEMM (E4M3 x E4M3) at DEFAULT: cuBLAS's fast accumulation; the backward
# GEMMs at HIGHEST: promoted accumulation (docs/NUMERICS.md, "Accumulation per GEMM").
_QUANTIZED_DOTS = {("fp8", "cuda"): {("f8E4M3FN", "f8E4M3FN", "f32", "DEFAULT"),
                                     ("f8E5M2", "f8E4M3FN", "f32", "HIGHEST"),
                                     ("f8E4M3FN", "f8E5M2", "f32", "HIGHEST")}}


def _with_backend(policy, backend):
    return dataclasses.replace(policy, **{
        g: dataclasses.replace(getattr(policy, g), backend=backend)
        for g in ("fprop", "dgrad", "wgrad")})


def _dot_train(policy):
    """value_and_grad of mxjax.dot_general (bf16 [64, 96] x [96, 80]) under `policy`."""
    key = jax.random.key(0) if policy.needs_key else None

    def f(a, b):
        def loss(a, b):
            y = es_dot(a, b, policy, key)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

    args = (jax.ShapeDtypeStruct((64, 96), jnp.bfloat16),
            jax.ShapeDtypeStruct((96, 80), jnp.bfloat16))
    return f, args


def es_dot(a, b, policy, key):
    import mxjax

    return mxjax.dot_general(a, b, (((1,), (0,)), ((), ())), policy=policy, key=key)


@functools.cache
def _train_fn(kind: str, policy_name: str, backend: str = "xla"):
    """(fn, abstract args), one per program: exporting the same fn for another platform
    reuses JAX's trace (the per-platform forms are chosen at lowering)."""
    policy = _with_backend(policies.get(policy_name), backend)
    if kind == "dot":
        return _dot_train(policy)
    cfg = LlamaConfig.tiny(vocab_size=64, n_layers=1, dtype="bfloat16")
    return es.layer_train_step(cfg, policy_name, batch=1, seq=32)


@functools.cache
def _text(kind: str, policy_name: str, platform: str, backend: str = "xla") -> str:
    return es.export_text(*_train_fn(kind, policy_name, backend), platform)


@functools.cache
def _shape(kind: str, policy_name: str, platform: str, backend: str = "xla") -> es.ModuleShape:
    return es.analyze(_text(kind, policy_name, platform, backend))


# The per-operand bounds of every preset: the dot program, in the default run. The decoder
# layer (21 GEMMs, 4-13 s of tracing and lowering each) under every preset only in `make
# test-slow` (the interceptor emits the same per-GEMM program wherever it is called, so the
# dot cases keep their bounds covered).
CASES = [("dot", 3, p) for p in POLICIES] + [
    pytest.param("layer", 21, p, marks=pytest.mark.slow) for p in POLICIES]


@pytest.mark.parametrize("kind,gemms,policy_name", CASES)
def test_accelerator_export_shape(kind, gemms, policy_name):
    # Both platforms in one test (one worker): the second export reuses the first's trace.
    for platform in PLATFORMS:
        s = _shape(kind, policy_name, platform)
        q = s.quantized
        assert len(q) == gemms, (platform, [d.signature for d in s.dots])
        assert s.f32_highest == 0, platform  # f32 x f32 at HIGHEST (f8 at HIGHEST is fine)
        assert {(d.lhs, d.rhs, d.out, d.precision) for d in q} == _QUANTIZED_DOTS.get(
            (policy_name, platform), {("bf16", "bf16", "f32", "DEFAULT")}), platform
        operands = 2 * gemms
        assert s.barriers <= BARRIERS_PER_OPERAND[platform][policy_name] * operands, (
            platform, s.barriers)
        assert "stablehlo.reverse" not in _text(kind, policy_name, platform), platform
        # An MXFP4 operand that tiles into the TPU kernel has its amax inside it.
        assert s.amax_reductions + s.tpu_kernels == AMAX_PER_OPERAND[policy_name] * operands, (
            platform, s.amax_reductions, s.tpu_kernels)
        if platform == "cuda" or not policy_name.startswith("mxfp4"):
            assert s.tpu_kernels == 0, platform
        if kind == "layer":  # no other dot at HIGHEST (attention stays pass-through bf16)
            assert all(d.precision != "HIGHEST" or "f8" in d.lhs for d in s.dots), platform


def test_cpu_export_keeps_the_cpu_form():
    """The same program lowered for CPU: f32 operands at HIGHEST, stages materialized."""
    s = _shape("dot", "mxfp4_all_h16", "cpu")
    assert len(s.quantized) == 3 and s.f32_highest == 3
    # fprop's 2 operands x (H16's 4 butterfly stages in two passes: one barrier between
    # them + rotated operand + quantized operand); the forward's packed residuals of X and W
    # (mxjax.residuals) x the same three; each backward GEMM: its lhs's three and one for
    # the values of its packed rhs
    assert s.barriers == 2 * 3 + 2 * 3 + 2 * (3 + 1)


def test_auto_backend_exported_for_cuda_from_cpu_is_the_xla_emulation():
    """'auto' resolves per lowering platform for the chip compiled for
    (mxjax.backends.AUTO_CHOICES): an export for cuda with no GPU target in sight
    (an unknown GPU), as for every chip where no kernel is estimated faster, carries
    the XLA emulation in its accelerator form (bf16 at DEFAULT)."""
    from mxjax.backends import resolve_backend

    assert jax.default_backend() == "cpu"
    assert resolve_backend("auto") == "xla"
    auto = _shape("dot", "mxfp4_all_h16", "cuda", backend="auto")
    xla = _shape("dot", "mxfp4_all_h16", "cuda", backend="xla")
    assert auto == xla
    # the GPU form's: two per operand quantized in place (BARRIERS_PER_OPERAND): fprop's two
    # and each backward GEMM's lhs; its rhs is the packed residual, read by integer ops
    assert auto.f32_highest == 0 and auto.barriers == (2 + 1 + 1) * 2


def test_analyzer_counts_calls_and_reads_precision():
    """The analyzer is exercised on a hand-written module: a private function called
    twice counts twice; precision and dtypes are parsed; a non-interceptor dot is not
    quantized."""
    lines = [
        "module @m {",
        "  func.func public @main(%a: tensor<4x8xf32>) -> tensor<4x4xf32> {",
        "    %0 = call @g(%a) : (tensor<4x8xf32>) -> tensor<4x4xf32> loc(#loc2)",
        "    %1 = call @g(%a) : (tensor<4x8xf32>) -> tensor<4x4xf32> loc(#loc2)",
        ("    %2 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [1] : "
         "(tensor<4x8xbf16>, tensor<4x8xbf16>) -> tensor<4x4xf32> loc(#loc3)"),
        "    return %0 : tensor<4x4xf32> loc(#loc2)",
        "  }",
        "  func.func private @g(%a: tensor<4x8xf32>) -> tensor<4x4xf32> {",
        "    %0 = stablehlo.optimization_barrier %a : tensor<4x8xf32> loc(#loc2)",
        ("    %1 = stablehlo.dot_general %0, %0, contracting_dims = [1] x [1], precision = "
         "[HIGHEST, HIGHEST] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x4xf32> loc(#loc4)"),
        "    return %1 : tensor<4x4xf32> loc(#loc2)",
        "  }",
        "}",
        '#loc1 = loc("/x/mxjax/dot_general.py":10:2)',
        '#loc2 = loc("elsewhere.py":1:1)',
        '#loc3 = loc("models/llama.py":3:4)',
        '#loc4 = loc(callsite("_xla_gemm"(#loc1) at #loc2))',
    ]
    text = "\n".join(lines)
    s = es.analyze(text)
    assert s.barriers == 2
    assert [d.signature for d in s.dots].count("f32 x f32 -> f32 @ HIGHEST") == 2
    assert len(s.quantized) == 2 and s.f32_highest == 2
    assert es.analyze(text, quantized_policy=False).quantized == ()


def test_cpu_barriers_hold_one_operand_each():
    """No barrier ties the weight to the activation (each operand's chain is its own)."""
    import re

    text = _text("dot", "mxfp4_all_h16", "cpu")
    operand_lists = re.findall(r"stablehlo\.optimization_barrier ([^:]*) :", text)
    assert len(operand_lists) == 2 * 3 + 2 * 3 + 2 * (3 + 1)  # as counted above
    assert all("," not in ops for ops in operand_lists), operand_lists


def test_tpu_mxfp4_operands_that_tile_are_one_kernel_each():
    """fwd+bwd of a [256, 256] x [256, 128] dot under mxfp4_all_h16 exported for TPU: six
    quantized operands, six Mosaic kernels (no amax reduction, barrier or reversal
    outside them), three bf16 GEMMs."""
    policy = policies.get("mxfp4_all_h16")

    def f(a, b):
        return jax.value_and_grad(lambda a, b: jnp.sum(jnp.square(es_dot(
            a, b, policy, None).astype(jnp.float32))), argnums=(0, 1))(a, b)

    args = (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((256, 128), jnp.bfloat16))
    # Traced for a TPU: the emulation keeps MX operands for its kernel (no packed residuals).
    dev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=dev)):
        text = es.export_text(f, args, "tpu")
    s = es.analyze(text)
    assert len(s.quantized) == 3 and s.f32_highest == 0
    assert s.tpu_kernels == 6
    assert s.amax_reductions == 0 and s.barriers == 0
    assert "stablehlo.reverse" not in text
