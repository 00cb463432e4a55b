"""`mxjax.shard_blocks`: which meshes keep every quantization block on one device."""

from __future__ import annotations

import pytest

import mxjax
from mxjax import GemmRecipe, OperandRecipe, PrecisionPolicy, policies
from mxjax.shard_blocks import contraction_step

MX = OperandRecipe(fmt="mxfp4", scale_rule="even")


@pytest.mark.parametrize("recipe, side, step", [
    (GemmRecipe(lhs=MX, rhs=MX), "rhs", 32),
    (GemmRecipe(lhs=MX, rhs=MX, hadamard=16), "lhs", 32),
    (GemmRecipe(lhs=MX, rhs=MX, hadamard=128), "rhs", 128),
    (GemmRecipe(lhs="nvfp4", rhs="nvfp4"), "rhs", 32),  # the kernels' 32-groups
    (GemmRecipe(lhs="mxfp8_e4m3", rhs="mxfp8_e4m3"), "lhs", 32),
    (GemmRecipe(lhs="fp8_e4m3", rhs="fp8_e4m3"), "rhs", 1),  # one scale per tensor
    (GemmRecipe(lhs="bf16", rhs="bf16"), "rhs", 1),
    (GemmRecipe(lhs="bf16", rhs="bf16", hadamard=64), "rhs", 64),  # a rotation alone
    (GemmRecipe(lhs=MX, rhs="bf16"), "rhs", 1),  # only the lhs is blocked
])
def test_contraction_step(recipe, side, step):
    assert contraction_step(recipe, side) == step


def test_contraction_step_names_a_bad_side():
    with pytest.raises(ValueError, match="side: expected 'lhs' or 'rhs'"):
        contraction_step(GemmRecipe(lhs=MX, rhs=MX), "out")


MESH = {"fsdp": 16, "tensor": 8, "data": 2}


def test_a_mesh_that_keeps_whole_blocks_has_no_problems():
    policy = policies.get("mxfp4_all_h16")
    kernels = {"wq": ((4096, 4096), ("fsdp", "tensor")),
               "w_down": ((32, 14336, 4096), (None, "tensor", "fsdp"))}  # stacked layers
    assert mxjax.linear_shard_problems(policy, kernels, MESH, tokens_per_shard=2048) == []
    mxjax.check_linear_shards(policy, kernels, MESH, tokens_per_shard=2048)  # no raise
    assert mxjax.linear_shard_problems(None, kernels, {"fsdp": 4096}) == []


def test_every_cut_block_is_named_with_its_gemm():
    policy = policies.get("mxfp4_all_h16")
    # 256 / 16 = 16 rows per device (fprop's contraction); 896 / 8 = 112 (dgrad's);
    # 4096 / 16 = 256 and 14336 / 8 = 1792 are whole blocks; 48 tokens are not.
    kernels = {"up": ((256, 896), ("fsdp", "tensor")), "ok": ((4096, 14336), ("fsdp", "tensor"))}
    problems = mxjax.linear_shard_problems(policy, kernels, MESH, tokens_per_shard=48)
    assert len(problems) == 3, problems
    assert problems[0].startswith("up: axis 0 (256 over mesh axes ('fsdp',): 16 per device) "
                                  "is fprop's contraction, quantized in blocks of 32")
    assert problems[1].startswith("up: axis 1 (896 over mesh axes ('tensor',): 112 per device) "
                                  "is dgrad's contraction")
    assert problems[2].startswith("tokens: 48 per device are wgrad's contraction")
    with pytest.raises(ValueError, match=r"(?s)shards would cut quantization blocks.*up: axis 0"):
        mxjax.check_linear_shards(policy, kernels, MESH, tokens_per_shard=48)


def test_each_gemm_is_held_to_its_own_recipe():
    # fprop in bf16 and dgrad in MXFP4: only d_out (dgrad's contraction) needs whole blocks;
    # a wgrad rotated by H128 needs 128 tokens per device.
    policy = PrecisionPolicy(fprop=None, dgrad=MX, wgrad=GemmRecipe(lhs=MX, rhs=MX, hadamard=128))
    kernels = {"w": ((256, 256), (("fsdp", "data"), "tensor"))}  # 8 rows, 32 columns per device
    assert mxjax.linear_shard_problems(policy, kernels, MESH, tokens_per_shard=96) == [
        ("tokens: 96 per device are wgrad's contraction, quantized in blocks of 128; 96 is not "
         "a multiple of 128")]
    kernels = {"w": ((256, 128), (None, "tensor"))}  # 16 columns per device
    assert "axis 1" in mxjax.linear_shard_problems(policy, kernels, MESH)[0]


def test_a_kernel_needs_two_axes():
    with pytest.raises(ValueError, match=r"kernels\['b'\]: expected a weight \[..., d_in, d_out\]"):
        mxjax.linear_shard_problems(policies.get("mxfp4_all"), {"b": ((64,), ("fsdp",))}, MESH)
