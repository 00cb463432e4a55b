"""FP8 GEMMs on FP8 tensor cores in XLA's optimized GPU programs (the ``fp8`` preset at FP8 rate).

Deviceless compiles for H100, H200 and B200 (bench/costmodel/aot.py), under both of XLA's GEMM
paths: its default Triton GEMM emitter and cuBLAS (``xla_gpu_enable_triton_gemm=false``,
bench/accelerator_cost.py's ``cublas`` variant). Asserted:

* ``fp8``: every quantized GEMM (the multiplies under ``jit(emulated_gemm)``) of the
  fwd+bwd matmul and of the Llama-3.2-1B decoder layer's train step (bench/costmodel/programs.py)
  reads f8 operands: E4M3 x E4M3 in fprop, E5M2 x E4M3 in dgrad (dY x W) and E4M3 x E5M2
  in wgrad (X x dY: mxjax.gemm swaps the wgrad's operands on CUDA), a Triton f8
  fusion or ``__cublas$lt$matmul$f8``, merged GEMMs (q|k|v, gate|up) included. An f8
  operand in the optimized program also means the FP8 rounding survived XLA (a folded
  f32 -> f8 -> bf16 round trip leaves bf16 operands);
* the accumulation each ``fp8`` GEMM asks for (Transformer Engine's recipe,
  mxjax.emulation.f8_accumulation): the forward E4M3 x E4M3 GEMMs at precision DEFAULT, which
  XLA's cuBLASLt thunk runs with ``CUBLASLT_MATMUL_DESC_FAST_ACCUM``, and every GEMM with an
  E5M2 gradient at HIGHEST (promoted accumulation), in the cuBLASLt call's precision_config
  and in the Triton fusion's dot (where XLA never promotes f8 accumulation, at any precision);
* ``mxfp8``: on B200 every quantized GEMM is cuDNN's block-scaled MMA
  (``__cudnn$blockScaledDot``) on E4M3 operands; on H200 (no block-scaled MMA) XLA
  expands ``jax.nn.scaled_matmul`` into a dequantize and an f32 GEMM, as
  docs/NUMERICS.md says.
"""

from __future__ import annotations

import collections
import functools
import re

import pytest

from bench.costmodel import aot
from bench.costmodel import hlo_kernels as hk
from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators

PATHS = {"triton": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}
E4M3, E5M2 = "f8e4m3fn", "f8e5m2"
# The 1B layer's quantized GEMMs after XLA's merges: 5 forward (q|k|v and gate|up merged
# where XLA merges them), 12 backward: dgrads E5M2 x E4M3 and wgrads E4M3 x E5M2 (how many
# of each XLA merges differs between targets and GEMM paths).
LAYER_FP8_FORWARD = {(E4M3, E4M3): 5}
LAYER_FP8_BACKWARD = 12
MATMUL_FP8 = {(E4M3, E4M3): 1, (E5M2, E4M3): 1, (E4M3, E5M2): 1}
F8_TARGETS = {"triton": ("fusion",), "cublas": ("__cublas$lt$matmul$f8",)}


@functools.cache
def _text(target: str, program: str, policy: str, path: str) -> str:
    from bench.costmodel.programs import program as build

    fn, args = build(program, policy)
    return aot.compile_for(fn, args, require(target), PATHS[path]).as_text()


@functools.cache
def _gemms(target: str, program: str, policy: str, path: str):
    return tuple(hk.gemm_operand_types(_text(target, program, policy, path)))


_CUBLAS_PRECISION = re.compile(r'"operand_precision":\["(\w+)","(\w+)"\]')


def _f8_gemm_precisions(text: str) -> list[tuple[tuple[str, str], str, str]]:
    """(operand types, 'cublas' or 'triton', precision) of every quantized f8 GEMM: the
    cuBLASLt call's precision_config (what XLA's cuBLASLt thunk reads: DEFAULT sets
    CUBLASLT_MATMUL_DESC_FAST_ACCUM), or the operand_precision of the dot in a fusion."""
    module = hk.parse_module(text)
    out = []
    for instructions in module.computations.values():
        types = {i.name: i.shape.split("[", 1)[0] for i in instructions}
        for inst in instructions:
            pair = tuple(types.get(o, "") for o in inst.operands[:2])
            if "emulated_gemm" not in inst.attributes or not all("f8" in t for t in pair):
                continue
            if inst.custom_call_target == "__cublas$lt$matmul$f8":
                lhs, rhs = _CUBLAS_PRECISION.search(inst.attributes).groups()
                assert lhs == rhs, inst.attributes
                out.append((pair, "cublas", lhs))
            elif inst.opcode == "dot":
                highest = "operand_precision={highest,highest}" in inst.attributes
                out.append((pair, "triton", "HIGHEST" if highest else "DEFAULT"))
    return out


def _quantized(gemms):
    return [g for g in gemms if "emulated_gemm" in g[3]]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("target", ["h100", "h200", "b200"])
def test_fp8_matmul_gemms_are_f8(target, path):
    q = _quantized(_gemms(target, "matmul", "fp8", path))
    assert collections.Counter(g[2] for g in q) == MATMUL_FP8, q
    assert {g[1] for g in q} == set(F8_TARGETS[path]), q


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("target", ["h200", "b200"])
def test_fp8_layer_every_quantized_gemm_is_f8(target, path):
    gemms = _gemms(target, "layer", "fp8", path)
    q = _quantized(gemms)
    counts = collections.Counter(g[2] for g in q)
    assert {k: counts[k] for k in LAYER_FP8_FORWARD} == LAYER_FP8_FORWARD, q
    backward = {k: n for k, n in counts.items() if k not in LAYER_FP8_FORWARD}
    assert set(backward) == {(E5M2, E4M3), (E4M3, E5M2)}, q
    assert sum(backward.values()) == LAYER_FP8_BACKWARD, q
    assert {g[1] for g in q} == set(F8_TARGETS[path]), q
    # The rest are the attention's GEMMs (pass-through, never f8).
    rest = [g for g in gemms if g not in q]
    assert rest and all("f8" not in "".join(g[2]) for g in rest), rest


def test_mxfp8_is_block_scaled_on_b200_and_xla_expanded_on_h200():
    for path in PATHS:
        q = _quantized(_gemms("b200", "matmul", "mxfp8", path))
        assert len(q) == 3 and all(g[1] == "__cudnn$blockScaledDot" and g[2] == (E4M3, E4M3)
                                   for g in q), (path, q)
        # XLA's expansion drops the op_name: every GEMM of the matmul program is quantized.
        h = _gemms("h200", "matmul", "mxfp8", path)
        assert len(h) == 3 and all(g[2] == ("f32", "f32") for g in h), (path, h)


# Transformer Engine's accumulation per GEMM (mxjax.emulation.f8_accumulation): the forward pair
# at DEFAULT (cuBLASLt fast accumulation), every pair with an E5M2 gradient at HIGHEST.
EXPECTED_PRECISION = {(E4M3, E4M3): "DEFAULT", (E5M2, E4M3): "HIGHEST", (E4M3, E5M2): "HIGHEST"}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("target", ["h200", "b200"])
def test_fp8_matmul_fast_accumulation_in_fprop_only(target, path):
    found = _f8_gemm_precisions(_text(target, "matmul", "fp8", path))
    assert sorted((pair, precision) for pair, _, precision in found) == sorted(
        EXPECTED_PRECISION.items()), found
    assert {how for _, how, _ in found} == {path}, found


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_fp8_layer_fast_accumulation_in_every_forward_gemm_only(target):
    found = _f8_gemm_precisions(_text(target, "layer", "fp8", "cublas"))
    assert len(found) == sum(LAYER_FP8_FORWARD.values()) + LAYER_FP8_BACKWARD, found
    assert all(precision == EXPECTED_PRECISION[pair] for pair, _, precision in found), found
