"""Policies built in Python, preset names that say
what they do, and one policy spec at every entry point (resolve, wrap, Rule; the train
config and the study are tested in tests/train and tests/study)."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import mxjax
import mxjax.nn as mnn
from mxjax import policies
from mxjax.formats import BF16, MXFP4, ScaleRule
from mxjax.policies import PrecisionPolicy
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe

ROOT = Path(__file__).resolve().parents[2]
PASS = GemmRecipe(lhs=BF16, rhs=BF16)


# ----------------------------------------------------------------------------- item 6
def test_each_gemm_takes_a_recipe_a_format_a_presets_gemm_or_none_for_pass_through():
    h16 = policies.get("mxfp4_all_h16")
    p = PrecisionPolicy(fprop="mxfp4", dgrad=None, wgrad=h16.wgrad)
    assert p.fprop == GemmRecipe(lhs="mxfp4", rhs="mxfp4")  # both operands, default recipe
    assert p.dgrad == PASS and p.wgrad is h16.wgrad
    assert PrecisionPolicy(fprop="bf16").fprop == PASS  # the pass-through format
    assert PrecisionPolicy(fprop=MXFP4).fprop == p.fprop
    even = OperandRecipe(fmt="mxfp4", scale_rule="even")
    assert PrecisionPolicy(fprop=even).fprop == h16.fprop.replace(hadamard=None)
    assert PrecisionPolicy() == policies.get("passthrough")  # every GEMM omitted: pass-through
    # still frozen, hashable, keyword-only
    assert hash(p) == hash(PrecisionPolicy(fprop=MXFP4, dgrad="bf16", wgrad=h16.wgrad))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fprop = PASS  # type: ignore[misc]
    with pytest.raises(TypeError):
        PrecisionPolicy(PASS, PASS, PASS)  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"fprop": 3}, TypeError, (r"PrecisionPolicy: fprop must be a GemmRecipe, an OperandRecipe"
                               r" or a format name .* or None / 'bf16' for pass-through; got int"
                               r" 3")),
    ({"wgrad": "mxfp5"}, ValueError, r"PrecisionPolicy: wgrad='mxfp5': fmt: unknown format"),
    ({"dgrad": "mxfp4_all_h16"}, ValueError,
     r"dgrad='mxfp4_all_h16': fmt: unknown format.*get\('mxfp4_all_h16'\)\.dgrad"),
    ({"fprop": policies.get("fp8")}, TypeError, r"fprop must be a GemmRecipe"),
])
def test_bad_gemm_specs_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        PrecisionPolicy(**kwargs)


def test_replace_on_policy_and_every_recipe_type_validates_again():
    h16 = policies.get("mxfp4_all_h16")
    no_fprop = h16.replace(fprop=None)
    assert no_fprop.fprop == PASS and no_fprop.gemms["wgrad"] == h16.wgrad
    assert no_fprop.name is None  # a changed preset is no longer that preset
    assert h16.replace(name="mine").name == "mine"
    assert h16.replace(wgrad="mxfp4").wgrad == GemmRecipe(lhs=MXFP4, rhs=MXFP4)
    with pytest.raises(TypeError, match="PrecisionPolicy.replace: unknown field.* fprp"):
        h16.replace(fprp=None)
    with pytest.raises(TypeError, match="fprop must be"):
        h16.replace(fprop=1.5)
    g = h16.wgrad.replace(hadamard=32, lhs="mxfp4")
    assert g.hadamard == Hadamard(block_size=32) and g.lhs == OperandRecipe(fmt=MXFP4)
    assert h16.wgrad.lhs.replace(scale_rule="floor") == OperandRecipe(fmt=MXFP4)
    assert Hadamard().replace(block_size=64) == Hadamard(block_size=64)
    with pytest.raises(ValueError, match="block_size"):
        h16.wgrad.hadamard.replace(block_size=24)
    with pytest.raises(ValueError, match="needs rounding=STOCHASTIC"):
        h16.wgrad.lhs.replace(sr_prescale=True)


def test_the_scale_rule_default_is_ocp_floor_the_presets_use_even_and_describe_says_which():
    # The default stays OCP's FLOOR, as mxjax.quantize's;
    # the paper's EVEN must be asked for, and describe() always names the rule.
    assert OperandRecipe(fmt="mxfp4").scale_rule is ScaleRule.FLOOR
    x = jax.random.normal(jax.random.key(0), (4, 64)) * 5
    by_default = mxjax.dequantize(mxjax.quantize(x, "mxfp4"))
    floor = mxjax.dequantize(mxjax.quantize(x, "mxfp4", scale_rule=ScaleRule.FLOOR))
    assert bool(jnp.all(by_default == floor))
    for g in policies.get("mxfp4_all").gemms.values():
        assert g.lhs.scale_rule is ScaleRule.EVEN and g.rhs.scale_rule is ScaleRule.EVEN
    naive = PrecisionPolicy(fprop="mxfp4", dgrad="mxfp4", wgrad="mxfp4")
    assert naive != policies.get("mxfp4_all")
    assert "mxfp4 floor/nearest_even" in naive.describe()
    assert "mxfp4 even/nearest_even" in policies.get("mxfp4_all").describe()


def _docs_example() -> str:
    text = (ROOT / "docs" / "policies.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 2, "docs/policies.md: expected two Python examples (data, then code)"
    return blocks[1]


def test_docs_python_example_builds_the_papers_recipe_from_constructors(capsys):
    ns: dict = {}
    exec(compile(_docs_example(), "docs/policies.md", "exec"), ns)  # noqa: S102 - our own docs
    assert ns["paper"] == policies.get("mxfp4_all_h16")
    assert ns["wgrad_only"].fprop.is_passthrough and ns["wgrad_only"].dgrad.is_passthrough
    assert ns["wgrad_only"].wgrad == policies.get("mxfp4_all_h16_wgrad").wgrad
    assert ns["no_fprop"].fprop.is_passthrough
    assert "fprop  X: bf16 (pass-through)" in capsys.readouterr().out
    assert ns["wrapped_rules"][0].policy is None


# ----------------------------------------------------------------------------- item 7
def test_renamed_presets_say_what_they_do_and_old_names_warn_with_the_new_name():
    wg = policies.get("mxfp4_all_h16_wgrad")
    mx = policies.get("mxfp4_all")
    assert wg.fprop == mx.fprop and wg.dgrad == mx.dgrad  # MXFP4 in all three GEMMs
    assert wg.wgrad == mx.wgrad.replace(hadamard=16)  # H16 on wgrad only
    for old, new in (("mxfp4_wgrad_h16", "mxfp4_all_h16_wgrad"), ("bf16", "passthrough")):
        for lookup in (policies.get, policies.resolve):
            with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated.*use '{new}'"):
                p = lookup(old)
            assert p == policies.get(new) and p.name == new
        assert old not in policies.names() and policies.ALIASES[old] == new


def test_passthrough_casts_nothing_an_f32_model_stays_f32():
    x = jax.random.normal(jax.random.key(0), (4, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))
    dims = (((1,), (0,)), ((), ()))
    y = mxjax.dot_general(x, w, dims, policy="passthrough")
    assert y.dtype == jnp.float32
    assert bool(jnp.all(y == jax.lax.dot_general(x, w, dims)))
    assert "Nothing\n    is cast" in policies.PRESETS["passthrough"].__doc__
    assert "`bf16` → `passthrough`" in (ROOT / "docs" / "policies.md").read_text()


# ----------------------------------------------------------------------------- item 8
class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="down")(jax.nn.relu(nn.Dense(32, name="up")(x)))


@pytest.fixture(scope="module")
def mlp():
    m = _MLP()
    x = jnp.ones((2, 32))
    return m, m.init(jax.random.key(0), x), x


SPECS = {
    "name": "mxfp4_all_h16",
    "dict": policies.to_dict("mxfp4_all_h16"),
    "policy": policies.get("mxfp4_all_h16"),
}


@pytest.mark.parametrize("form", sorted(SPECS))
def test_wrap_and_rule_take_every_form_resolve_takes(mlp, form):
    m, v, x = mlp
    spec = SPECS[form]
    want = policies.resolve(spec)
    assert mnn.Rule(path="up", policy=spec).policy == want
    report = mnn.wrap(m, spec).report(v, x)
    assert {s.path: s.policy for s in report.sites} == {"up": want, "down": want}


@pytest.mark.parametrize("none", ["none", "None", None])
def test_wrap_and_rule_take_no_policy(mlp, none):
    m, v, x = mlp
    assert mnn.Rule(path="up", policy=none).policy is None
    wrapped = mnn.wrap(m, none)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule matched (its policy is 'leave unchanged')
        y = wrapped.apply(v, x)
    assert bool(jnp.all(y == m.apply(v, x)))
    assert wrapped.last_report.modules == {"up": None, "down": None}


@pytest.mark.parametrize("spec, exc, match", [
    ("mxfp3", ValueError, r"unknown preset 'mxfp3'; did you mean 'mxfp8'\?"),
    ({"fprop": {}}, ValueError, r"fprop: missing keys \['lhs', 'rhs'\]"),
    (3, TypeError, r"expected a preset name, None or 'none', a policy dict or a PrecisionPolicy"),
])
def test_rule_and_wrap_errors_name_the_argument(mlp, spec, exc, match):
    with pytest.raises(exc, match="Rule: policy: " + match):
        mnn.Rule(path=".*", policy=spec)
    if not isinstance(spec, int):
        with pytest.raises(exc, match="policy_or_rules: policy: " + match):
            mnn.wrap(mlp[0], spec)


# ----------------------------------------------------------------------------- item 13
def test_rule_repr_is_short():
    assert repr(mnn.Rule(path="down", policy="mxfp4_all_h16")) == (
        "Rule(path='down', policy='mxfp4_all_h16', operands='weight')")
    custom = policies.get("mxfp4_all_h16").replace(fprop=None)
    assert repr(mnn.Rule(path=".*", policy=custom, operands="any")) == (
        "Rule(path='.*', policy=<custom PrecisionPolicy>, operands='any')")
    assert repr(mnn.Rule(path="a|b", policy=None, operands=("weight", "head"))) == (
        "Rule(path='a|b', policy=None, operands=('weight', 'head'))")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        every = [mnn.Rule(path=".*", policy=n) for n in policies.names()]
    assert max(len(repr(r)) for r in every) < 100


def test_preset_tables_list_every_preset_and_alias():
    docs = (ROOT / "docs" / "policies.md").read_text()
    for name in policies.names():
        assert re.search(rf"^{name}\s", policies.__doc__, re.MULTILINE), name
        assert f"| `{name}` |" in docs, name
    for old, new in policies.ALIASES.items():
        assert f"``{old}`` → ``{new}``" in policies.__doc__
        assert f"`{old}` → `{new}`" in docs
    assert not hasattr(policies, "ABLATIONS")  # the study's (study.policies)
