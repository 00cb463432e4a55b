"""mxjax's native FP4 GEMM kernels compiled deviceless (bench/native_fp4.py).

The Pallas kernels ('pallas', 'pallas_fp8') lower for a B200 (sm_100a) and an H200
(sm_90a) to XLA Triton custom calls; the 'triton' backend's ``tl.dot_scaled`` kernel,
compiled by Triton for sm_100, is Blackwell's block-scaled FP4 MMA
(``tcgen05.mma ... kind::mxf4 ... block_scale``) and for sm_90 bf16 ``wgmma`` (Hopper
has no FP4 units). triton comes with the ``aot-gpu`` extra.
"""

from __future__ import annotations

import pytest

from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators


@pytest.mark.parametrize("target", ["b200", "h200"])
@pytest.mark.parametrize("path", ["pallas", "pallas_fp8"])
def test_pallas_kernels_lower(target, path):
    from bench import native_fp4

    require(target)
    r = native_fp4.compile_path(target, path, 1024)
    assert r.ok, r.error
    assert "__gpu$xla.gpu.triton" in r.kernels


def test_dot_scaled_is_native_block_scaled_mma_on_b200_only():
    from bench import native_fp4

    b200 = native_fp4.count_instructions(native_fp4.triton_ptx("b200", 1024))
    assert b200["tcgen05 block-scaled"] > 0 and b200["kind::mxf4*"] > 0
    h200 = native_fp4.count_instructions(native_fp4.triton_ptx("h200", 1024))
    assert h200["tcgen05.mma"] == 0 and h200["wgmma.mma_async"] > 0
