"""bench/costmodel/hlo_kernels.py on a hand-written optimized HLO module (no accelerator
packages)."""

from __future__ import annotations

from bench.costmodel import hlo_kernels as hk

_GEMM_CONFIG = ('{"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":'
                '["1"],"rhs_contracting_dimensions":["0"]}}}')
HLO = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> f32[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_scale (p0.1: bf16[64,32]) -> (bf16[64,32], u32[64,1]) {
  %p0.1 = bf16[64,32]{1,0} parameter(0)
  %c = bf16[] constant(2)
  %b = bf16[64,32]{1,0} broadcast(%c), dimensions={}
  %m = bf16[64,32]{1,0} multiply(%p0.1, %b)
  %cv = u32[64,32]{1,0} convert(%m)
  %r = u32[64,1]{1,0} slice(%cv), slice={[0:64], [0:1]}
  ROOT %t = (bf16[64,32]{1,0}, u32[64,1]{1,0}) tuple(%m, %r)
}

ENTRY %main (x: bf16[64,32]) -> f32[64,16] {
  %x = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[32,16]{1,0} constant({...})
  %cs = (bf16[32,16]{1,0:T(8,128)(2,1)S(1)}, bf16[32,16]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[32,16]{1,0} copy-done(%cs)
  %f = (bf16[64,32]{1,0}, u32[64,1]{1,0}) fusion(%x), kind=kLoop, calls=%fused_scale
  %g = bf16[64,32]{1,0} get-tuple-element(%f), index=0
  %cc = (f32[64,16]{1,0}, s8[4096]{0}) custom-call(%g, %cd), CUBLAS
  %r0 = f32[64,16]{1,0} get-tuple-element(%cc), index=0
  %k = f32[64,16]{1,0} custom-call(%r0), custom_call_target="tpu_custom_call"
  ROOT %d = f32[64,16]{1,0} fusion(%g, %cd), kind=kCustom, calls=%fused_dot
}
""".replace("CUBLAS", f'custom_call_target="__cublas$lt$matmul", backend_config={_GEMM_CONFIG}')


def test_kernels_categories_bytes_and_flops():
    ks = {k.name: k for k in hk.kernels(HLO)}
    assert list(ks) == ["cs", "f", "cc", "k", "d"]  # schedule order; free ops dropped
    assert {n: k.category for n, k in ks.items()} == {
        "cs": "copy", "f": "fusion", "cc": "gemm", "k": "custom-call", "d": "gemm"}
    assert ks["cs"].bytes == 32 * 16 * 2 * 2  # one read, one write of the copied array
    assert ks["f"].bytes_read == 64 * 32 * 2 and ks["f"].bytes_written == 64 * 32 * 2 + 64 * 4
    assert ks["f"].alu_ops == 2 * 64 * 32  # multiply and convert; broadcast/slice are free
    assert ks["cc"].gemm_flops == 2 * 64 * 16 * 32 and ks["d"].gemm_flops == 2 * 64 * 16 * 32
    assert ks["cc"].bytes_written == 64 * 16 * 4  # the cuBLAS workspace is not counted
    assert ks["k"].target == "tpu_custom_call" and ks["d"].fusion_kind == "kCustom"
    assert hk.count_by_category(list(ks.values())) == {
        "fusion": 1, "gemm": 2, "custom-call": 1, "copy": 1, "other": 0}


def test_shape_bytes_of_tuples_and_sub_byte_types():
    assert hk.shape_bytes("(f32[2,3]{1,0}, bf16[4]{0:T(128)})") == 24 + 8
    assert hk.shape_bytes("f4e2m1fn[1,4096,4096]{2,1,0:E(4)}") == 4096 * 4096 // 2
    assert hk.shape_bytes("pred[]") == 1 and hk.shape_bytes("token[]") == 0


FUSED_KERNEL_HLO = """HloModule m2, is_scheduled=true

%fused_convert (q0: f32[64,128]) -> bf16[64,128] {
  %q0 = f32[64,128]{1,0} parameter(0)
  ROOT %cv.1 = bf16[64,128]{1,0} convert(%q0)
}

%fused_kernel (q1: f32[64,128]) -> bf16[64,128] {
  %q1 = f32[64,128]{1,0} parameter(0)
  %in = bf16[64,128]{1,0} fusion(%q1), kind=kLoop, calls=%fused_convert
  ROOT %pk = bf16[64,128]{1,0} custom-call(%in), custom_call_target="tpu_custom_call"
}

ENTRY %main2 (w: f32[64,128]) -> bf16[64,128] {
  %w = f32[64,128]{1,0} parameter(0)
  ROOT %fk = bf16[64,128]{1,0} fusion(%w), kind=kCustom, calls=%fused_kernel
}
"""


def test_a_kernel_with_a_fused_producer_is_its_custom_call():
    """XLA's TPU input fusion wraps a Pallas kernel and its operand's producer in a kCustom
    fusion: one custom-call kernel, reading the producer's input, matched to its spec by
    the inner call's operand."""
    (k,) = hk.kernels(FUSED_KERNEL_HLO)
    assert (k.name, k.category, k.target) == ("fk", "custom-call", "tpu_custom_call")
    assert k.bytes_read == 64 * 128 * 4 and k.bytes_written == 64 * 128 * 2
    assert [s.split("{")[0] for s in k.call_operands] == ["bf16[64,128]"]
    assert [s.split("{")[0] for s in hk.kernels(HLO)[3].call_operands] == ["f32[64,16]"]


COND_HLO = """HloModule c, is_scheduled=true

%on_true (p: (f32[8,8], f32[8,8])) -> f32[8,8] {
  %p = (f32[8,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %a = f32[8,8]{1,0} get-tuple-element(%p), index=0
  %b = f32[8,8]{1,0} get-tuple-element(%p), index=1
  ROOT %dt = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%on_false (q: (f32[8,8], f32[8,8])) -> f32[8,8] {
  %q = (f32[8,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %c = f32[8,8]{1,0} get-tuple-element(%q), index=0
  ROOT %n = f32[8,8]{1,0} negate(%c)
}

ENTRY %main (pred: pred[], x: f32[8,8], y: f32[8,8]) -> f32[8,8] {
  %pred = pred[] parameter(0)
  %x = f32[8,8]{1,0} parameter(1)
  %y = f32[8,8]{1,0} parameter(2)
  %t = (f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(%x, %y)
  ROOT %r = f32[8,8]{1,0} conditional(%pred, %t, %t), BRANCHES
}
""".replace("BRANCHES", "true_computation=%on_true, false_computation=%on_false")


def test_a_predicate_conditionals_branches_are_walked():
    """A bool-predicate conditional prints true_computation= / false_computation= (not
    branch_computations=): both are its called computations, and the roofline charges the
    true branch (mxjax's exact routes' fast path) only."""
    module = hk.parse_module(COND_HLO)
    r = next(i for i in module.computations[module.entry] if i.opcode == "conditional")
    assert r.called == ("on_true", "on_false")
    assert r.charged == ("on_true",)
    assert [g[1:3] for g in hk.gemm_operand_types(COND_HLO)] == [("dot", ("f32", "f32"))]
    assert [k.name for k in hk.kernels(COND_HLO)] == ["dt"]  # the false branch's negate: not
    swapped = COND_HLO.replace("true_computation=%on_true, false_computation=%on_false",
                               "true_computation=%on_false, false_computation=%on_true")
    assert [k.name for k in hk.kernels(swapped)] == ["n"] and not hk.gemm_operand_types(swapped)
