"""Policies as data take every form Python takes: a GEMM may be null, omitted, a format
name, one operand's fields or the full recipe; Python -> dict -> Python is the identity."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mxjax
from mxjax import PrecisionPolicy, policies
from mxjax.backends import BACKENDS
from mxjax.formats import Rounding, ScaleRule
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe

FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4")


@pytest.mark.parametrize("gemm, python", [
    (None, None),
    ("mxfp4", "mxfp4"),
    ("bf16", None),
    ({"fmt": "mxfp4", "scale_rule": "even"}, OperandRecipe(fmt="mxfp4", scale_rule="even")),
    ({"lhs": "mxfp4", "rhs": {"fmt": "mxfp4", "rounding": "stochastic"}},
     GemmRecipe(lhs="mxfp4", rhs=OperandRecipe(fmt="mxfp4", rounding="stochastic"))),
])
def test_a_dict_gemm_takes_what_python_takes(gemm, python):
    got = policies.from_dict({"fprop": gemm, "dgrad": gemm})  # wgrad omitted: pass-through
    assert got == PrecisionPolicy(fprop=python, dgrad=python)
    assert got.wgrad.is_passthrough
    # and the same through YAML and resolve, as a config file or --policy would give it
    text = yaml.safe_dump({"fprop": gemm, "dgrad": gemm})
    assert policies.resolve(yaml.safe_load(text)) == got


def test_yaml_shorthand_of_the_readme():
    spec = yaml.safe_load("{name: mine, fprop: mxfp4, dgrad: null}")
    assert policies.resolve(spec) == PrecisionPolicy(fprop="mxfp4", name="mine")
    assert policies.resolve(spec).name == "mine"
    assert policies.from_dict({}) == PrecisionPolicy()  # everything pass-through


@pytest.mark.parametrize("gemm, exc, match", [
    ({"lhs": "mxfp4"}, ValueError, r"fprop: missing keys \['rhs'\]"),
    ({"scale_rule": "even"}, ValueError, (r"fprop: a GEMM is null, a format name, one "
                                         r"operand's fields")),
    # one operand's fields mixed with a GEMM's: the forms a GEMM takes, not 'unknown keys'
    ({"fmt": "mxfp4", "hadamard": 16}, ValueError,
     r"fprop: a GEMM is null, a format name, .* got keys \['fmt', 'hadamard'\]"),
    ({"fmt": "mxfp4", "rounding": "bogus"}, ValueError, r"rounding: unknown 'bogus'"),
    # not a mapping: the forms too (it once said 'expected a mapping', though a string or
    # null is one as well)
    (3, TypeError, r"fprop: a GEMM is null, a format name, .* got int 3"),
    ("mxfp9", ValueError, r"fprop='mxfp9': fmt: unknown format 'mxfp9'"),
])
def test_bad_dict_gemms_name_the_gemm(gemm, exc, match):
    with pytest.raises(exc, match=match):
        policies.from_dict({"fprop": gemm})


def test_summary_of_an_unknown_preset_names_the_valid_ones():
    assert policies.summary("mxfp4_all_h16").startswith("The paper's recipe")
    with pytest.raises(KeyError, match=r"summary: unknown preset 'mxfp4'; valid names: "
                                       r"passthrough, fp8, "):
        policies.summary("mxfp4")


_operands = st.builds(
    lambda fmt, rule, rounding, pre: (fmt, rule, rounding, pre),
    st.sampled_from(FORMATS), st.sampled_from(list(ScaleRule)), st.sampled_from(list(Rounding)),
    st.booleans())
_hadamards = st.one_of(st.none(), st.builds(
    lambda h, randomized, seed: (h, randomized, None if randomized else seed),
    st.sampled_from((16, 32, 64, 128)), st.booleans(), st.one_of(st.none(), st.integers(0, 99))))


def _operand(t):
    fmt, rule, rounding, pre = t
    return OperandRecipe(fmt=fmt, scale_rule=rule, rounding=rounding, sr_prescale=pre)


@st.composite
def _policies(draw):
    gemms = {}
    for g in ("fprop", "dgrad", "wgrad"):
        kind = draw(st.sampled_from(("none", "format", "operand", "recipe")))
        try:
            if kind == "none":
                gemms[g] = None
            elif kind == "format":
                gemms[g] = draw(st.sampled_from(FORMATS))
            elif kind == "operand":
                gemms[g] = _operand(draw(_operands))
            else:
                had = draw(_hadamards)
                gemms[g] = GemmRecipe(
                    lhs=_operand(draw(_operands)), rhs=_operand(draw(_operands)),
                    hadamard=None if had is None else Hadamard(block_size=had[0],
                                                               randomized=had[1], seed=had[2]),
                    backend=draw(st.sampled_from(BACKENDS)))
            policy = PrecisionPolicy(**gemms, name=draw(st.one_of(st.none(), st.text(
                "abcdefgh_@", min_size=1, max_size=12))))
        except (TypeError, ValueError):  # a combination the recipes refuse
            assume(False)
    return policy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_policies())
def test_python_to_dict_to_python_is_the_identity(policy):
    d = policies.to_dict(policy)
    assert json.loads(json.dumps(d)) == d  # plain data
    back = policies.from_dict(yaml.safe_load(yaml.safe_dump(d)))
    assert back == policy and back.name == policy.name
    assert policies.to_dict(back) == d


@pytest.mark.parametrize("name", policies.names())
def test_every_preset_round_trips(name):
    p = policies.get(name)
    assert policies.from_dict(policies.to_dict(p)) == p
    assert mxjax.policies.resolve(policies.to_dict(p)).name == name
