"""The study's ablation presets (study.policies): each changes one thing of a rung."""

from __future__ import annotations

import pytest

from mxjax import policies
from mxjax.formats import BF16
from mxjax.policies import PrecisionPolicy
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe
from study import policies as SP

PASS = GemmRecipe(lhs=BF16, rhs=BF16)


@pytest.mark.parametrize("name, on", [
    ("mxfp4_all_h16_fprop", "fprop"), ("mxfp4_all_h16_dgrad", "dgrad"),
    ("mxfp4_all_h16_wgrad", "wgrad"),
])
def test_h16_on_one_gemm_presets(name, on):
    p, mx = SP.get(name), policies.get("mxfp4_all")
    assert p.gemms == {**mx.gemms, on: mx.gemms[on].replace(hadamard=16)}
    assert p.name == name


def test_wgrad_only_presets_change_one_thing():
    mx = policies.get("mxfp4_all").wgrad
    pt = OperandRecipe(fmt=BF16)
    want = {
        "mxfp4_wgrad_only": mx,
        "mxfp4_wgrad_only_h16": mx.replace(hadamard=16),
        "mxfp4_wgrad_only_rht16": mx.replace(hadamard=Hadamard(randomized=True)),
        "mxfp4_wgrad_only_h32": mx.replace(hadamard=32),
        "mxfp4_wgrad_only_dy": mx.replace(rhs=pt),
        "mxfp4_wgrad_only_dy_h16": mx.replace(rhs=pt, hadamard=16),
        "mxfp4_wgrad_only_x": mx.replace(lhs=pt),
        "mxfp4_wgrad_only_x_h16": mx.replace(lhs=pt, hadamard=16),
        "passthrough_wgrad_h16": PASS.replace(hadamard=16),
    }
    assert set(want) | {"mxfp4_all_h16_fprop", "mxfp4_all_h16_dgrad"} == set(SP.ABLATION_PRESETS)
    for name, wgrad in want.items():
        assert SP.get(name) == PrecisionPolicy(wgrad=wgrad), name
        assert SP.describe(name).startswith(("Ablation:", "A control:"))
