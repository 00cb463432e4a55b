"""mxjax's native FP4 GEMM kernels compiled deviceless (bench/costmodel/native_fp4.py).

The 'triton' backend's ``tl.dot_scaled`` kernel,
compiled by Triton for sm_100, is Blackwell's block-scaled FP4 MMA
(``tcgen05.mma ... kind::mxf4 ... block_scale``) and for sm_90 bf16 ``wgmma`` (Hopper
has no FP4 units). Triton's AMD backend compiles the same kernel for an MI355X (gfx950)
to block-scaled MFMA on E2M1 operands (``v_mfma_scale_f32_*_f8f6f4 ... cbsz:4 blgp:4``)
and for an MI300X (gfx942) to bf16 MFMA. triton comes with the ``aot-gpu`` extra.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.accelerators


def test_dot_scaled_is_native_block_scaled_mma_on_b200_only():
    from bench.costmodel import native_fp4

    b200 = native_fp4.count_instructions(native_fp4.triton_ptx("b200", 1024))
    assert b200["tcgen05 block-scaled"] > 0 and b200["kind::mxf4*"] > 0
    h200 = native_fp4.count_instructions(native_fp4.triton_ptx("h200", 1024))
    assert h200["tcgen05.mma"] == 0 and h200["wgmma.mma_async"] > 0


def test_dot_scaled_is_scaled_mfma_on_mi355x_only():
    from bench.costmodel import native_fp4

    why = native_fp4.amd_unavailable_reason()
    if why:
        pytest.skip(f"Triton's AMD backend is missing: {why}")
    mi355x = native_fp4.count_amd_instructions(native_fp4.triton_amdgcn("mi355x", 1024))
    scaled = mi355x["v_mfma_scale 32x32x64"] + mi355x["v_mfma_scale 16x16x128"]
    assert scaled > 0, mi355x
    # Every scaled MFMA takes both operands as E2M1 (format code 4), and no other MFMA runs.
    assert mi355x["e2m1 x e2m1 (cbsz:4 blgp:4)"] == scaled, mi355x
    assert mi355x["other v_mfma"] == 0, mi355x
    mi300x = native_fp4.count_amd_instructions(native_fp4.triton_amdgcn("mi300x", 1024))
    assert mi300x["v_mfma_scale 32x32x64"] + mi300x["v_mfma_scale 16x16x128"] == 0, mi300x
    assert mi300x["other v_mfma"] > 0, mi300x


def test_count_amd_instructions_reads_formats():
    from bench.costmodel import native_fp4

    asm = ("\tv_mfma_scale_f32_32x32x64_f8f6f4 v[2:17], v[74:77], v[58:61], v[2:17], v54, v53 "
           "op_sel_hi:[0,0,0] cbsz:4 blgp:4\n"
           "\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[0:3], v1, v2 "
           "cbsz:0 blgp:4\n"
           "\tv_mfma_f32_32x32x8_bf16 v[0:15], v[16:17], v[18:19], v[0:15]\n")
    assert native_fp4.count_amd_instructions(asm) == {
        "v_mfma_scale 32x32x64": 1, "v_mfma_scale 16x16x128": 1,
        "e2m1 x e2m1 (cbsz:4 blgp:4)": 1, "other v_mfma": 1}
    with pytest.raises(ValueError, match="target"):
        native_fp4.triton_amdgcn("b200", 1024)
