"""mxjax.recipes and mxjax.policies: construction, validation, presets, dict round trip."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

import mxjax
from mxjax import formats as F
from mxjax import policies
from mxjax.formats import BF16, FP8_E4M3, FP8_E5M2, MXFP4, NVFP4, Rounding, ScaleRule
from mxjax.policies import PrecisionPolicy
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe
from mxjax.validation import check_keys

EXPECTED_PRESETS = (
    "passthrough", "fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all", "mxfp4_all_sr",
    "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32", "mxfp4_all_h16_wgrad",
    "mxfp8", "nvfp4", "tseng",
)


def _mx(**kw):
    return OperandRecipe(fmt=MXFP4, **kw)


# ----------------------------------------------------------------------------- construction
def test_operand_recipe_coerces_names_and_is_frozen_hashable():
    r = OperandRecipe(fmt="mxfp4", scale_rule="even", rounding="stochastic")
    assert r.fmt is MXFP4 and r.scale_rule is ScaleRule.EVEN and r.rounding is Rounding.STOCHASTIC
    assert r == OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN, rounding=Rounding.STOCHASTIC)
    assert hash(r) == hash(OperandRecipe(fmt=MXFP4, scale_rule="even", rounding="stochastic"))
    assert r.needs_key and not r.is_passthrough
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fmt = BF16
    with pytest.raises(TypeError):
        OperandRecipe(MXFP4)  # keyword-only


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fmt": "mxfp5"}, "unknown format"),
        ({"fmt": MXFP4, "scale_rule": "round"}, "scale_rule"),
        ({"fmt": MXFP4, "rounding": "up"}, "rounding"),
        ({"fmt": NVFP4, "scale_rule": ScaleRule.EVEN}, "E8M0-scaled MX formats only"),
        ({"fmt": FP8_E4M3, "scale_rule": ScaleRule.CEIL}, "E8M0-scaled MX formats only"),
        ({"fmt": BF16, "rounding": Rounding.STOCHASTIC}, "pass-through"),
        ({"fmt": MXFP4, "sr_prescale": True}, "needs rounding=STOCHASTIC"),
        ({"fmt": MXFP4, "rounding": "stochastic", "sr_prescale": 1}, "sr_prescale"),
    ],
)
def test_operand_recipe_rejects_bad_fields(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        OperandRecipe(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 8}, "one of"),
        ({"block_size": 48}, "one of"),
        ({"block_size": 16.0}, "must be an int"),
        ({"block_size": True}, "must be an int"),
        ({"randomized": True, "seed": 3}, "one or the other"),
        ({"seed": -1}, "non-negative"),
        ({"randomized": "yes"}, "bool"),
    ],
)
def test_hadamard_rejects_bad_fields(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Hadamard(**kwargs)


def test_gemm_recipe_coercions_and_errors():
    g = GemmRecipe(lhs="mxfp4", rhs=FP8_E5M2, hadamard=32)
    assert g.lhs == OperandRecipe(fmt=MXFP4) and g.rhs == OperandRecipe(fmt=FP8_E5M2)
    assert g.hadamard == Hadamard(block_size=32) and g.backend == "xla"
    assert not g.is_passthrough and not g.needs_key
    assert GemmRecipe(lhs=BF16, rhs=BF16).is_passthrough
    assert not GemmRecipe(lhs=BF16, rhs=BF16, hadamard=16).is_passthrough
    assert GemmRecipe(lhs=BF16, rhs=BF16, hadamard=Hadamard(randomized=True)).needs_key
    with pytest.raises(ValueError, match="backend"):
        GemmRecipe(lhs=MXFP4, rhs=MXFP4, backend="cuda")
    with pytest.raises(TypeError, match="lhs"):
        GemmRecipe(lhs=3, rhs=MXFP4)
    with pytest.raises(TypeError, match="hadamard"):
        GemmRecipe(lhs=MXFP4, rhs=MXFP4, hadamard="h16")
    with pytest.raises(ValueError, match="block_size"):
        GemmRecipe(lhs=MXFP4, rhs=MXFP4, hadamard=24)


def test_precision_policy_validation_equality_and_static_jit_use():
    g = GemmRecipe(lhs=_mx(), rhs=_mx())
    p = PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="a")
    q = PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="b")
    assert p == q and hash(p) == hash(q)  # the name is a label, not part of identity
    with pytest.raises(TypeError, match="dgrad must be a GemmRecipe"):
        PrecisionPolicy(fprop=g, dgrad=3, wgrad=g)
    with pytest.raises(TypeError):
        PrecisionPolicy(g, g, g)
    with pytest.raises(TypeError, match="name"):
        PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name=3)
    assert p.replace(name="c").name == "c"

    traces = []

    def f(x, pol):
        traces.append(pol)
        return x * 2

    f = jax.jit(f, static_argnums=1)
    assert float(f(1.0, p)) == 2.0 and float(f(1.0, q)) == 2.0
    assert len(traces) == 1  # equal policies hit the same jit cache entry


# ----------------------------------------------------------------------------- presets
def test_names_lists_every_design_preset():
    assert policies.names() == EXPECTED_PRESETS


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_preset_has_docstring_name_and_roundtrips_through_json(name):
    p = policies.get(name)
    assert isinstance(p, PrecisionPolicy) and p.name == name
    doc = policies.PRESETS[name].__doc__
    assert doc and len(doc.split()) > 10
    d = policies.to_dict(p)
    back = policies.from_dict(json.loads(json.dumps(d)))
    assert back == p and back.name == name
    table = p.describe()
    for word in ("fprop", "dgrad", "wgrad", "X:", "W:", "dY:"):
        assert word in table
    assert str(p) == table


def test_unknown_preset_lists_valid_names_when_none_is_close():
    with pytest.raises(ValueError) as e:
        policies.get("qqq_unrelated")
    for n in EXPECTED_PRESETS:
        assert n in str(e.value)
    with pytest.raises(ValueError) as e:
        policies.get("mxfp3_all")  # a close name: suggested, and the message stays short
    assert "did you mean 'mxfp4_all'" in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_resolve_takes_every_form_of_a_policy(name):
    preset = policies.get(name)
    assert policies.resolve(name) == preset and policies.resolve(name).name == name
    assert policies.resolve(preset) is preset  # a PrecisionPolicy comes back unchanged
    from_dict = policies.resolve(json.loads(json.dumps(policies.to_dict(preset))))
    assert from_dict == preset and from_dict.name == name


def test_resolve_no_policy():
    for spec in (None, "none", "None", "NONE"):
        assert policies.resolve(spec) is None


@pytest.mark.parametrize("spec, exc, match", [
    ("mxfp3_all", ValueError, (r"unknown preset 'mxfp3_all'; did you mean 'mxfp4_all' or "
                              r"'mxfp4_all_sr'\? \(every preset: mxjax.policies.names\(\), "
                              r"python -m train --list-policies\)$")),
    ("zzz", ValueError, r"unknown preset 'zzz'; valid names: none, passthrough, "),
    ("mxfp4all@auto", ValueError, r"did you mean 'mxfp4_all@auto' or"),
    ("nope@xla", ValueError, r"unknown preset 'nope@xla'; valid names"),  # never 'none@xla'
    ("x" * 500, ValueError, r"unknown preset 'x{55}\.\.\.'; valid names"),  # kept short
    ("", ValueError, r"unknown preset ''"),
    # a known preset on an unknown backend: the message names the spec, not just 'backend'
    ("mxfp4_all@xla_fp9", ValueError, r"policy 'mxfp4_all@xla_fp9': backend: expected one of"),
    ("fp8@", ValueError, r"policy 'fp8@': backend: expected one of .*, got ''"),
    ("MXFP4_ALL", ValueError, r"unknown preset 'MXFP4_ALL'; did you mean 'mxfp4_all'"),
    ({"fprop": {"lhs": "mxfp4"}}, ValueError, r"fprop: missing keys \['rhs'\]"),
    ({**policies.to_dict("fp8"), "extra": 1}, ValueError, r"policy dict: unknown keys \['extra'\]"),
    ({**policies.to_dict("fp8"), "fprop": 3}, TypeError,
     r"fprop: a GEMM is null, a format name, .* got int 3"),
    (3, TypeError, r"a policy dict or a PrecisionPolicy, got int 3"),
    (["mxfp4_all"], TypeError, r"got list"),
    (policies.get("fp8").fprop, TypeError, r"got GemmRecipe"),
])
def test_resolve_names_what_it_expected(spec, exc, match):
    with pytest.raises(exc, match=match):
        policies.resolve(spec)


def test_dot_general_resolves_names_and_dicts_through_resolve(monkeypatch):
    x, w = jax.numpy.ones((4, 32)), jax.numpy.ones((32, 8))
    dims = (((1,), (0,)), ((), ()))
    seen = []
    real = policies.resolve
    monkeypatch.setattr(policies.lookup, "resolve",
                        lambda spec: seen.append(spec) or real(spec))
    by_name = mxjax.dot_general(x, w, dims, policy="passthrough")
    by_dict = mxjax.dot_general(x, w, dims, policy=policies.to_dict("passthrough"))
    by_policy = mxjax.dot_general(x, w, dims, policy=policies.get("passthrough"))
    assert seen == ["passthrough", policies.to_dict("passthrough")]
    assert (by_name == by_policy).all() and (by_dict == by_policy).all()
    for spec in ("none", None):
        with pytest.raises(TypeError, match="expected a PrecisionPolicy, a preset name or a "
                                            "policy dict"):
            mxjax.dot_general(x, w, dims, policy=spec)


def test_preset_contents_match_design():
    mx_even = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN)
    pt = GemmRecipe(lhs=BF16, rhs=BF16)
    assert policies.get("passthrough").is_passthrough
    fp8 = policies.get("fp8")
    assert (fp8.fprop.lhs.fmt, fp8.fprop.rhs.fmt) == (FP8_E4M3, FP8_E4M3)
    assert (fp8.dgrad.lhs.fmt, fp8.dgrad.rhs.fmt) == (FP8_E5M2, FP8_E4M3)
    assert (fp8.wgrad.lhs.fmt, fp8.wgrad.rhs.fmt) == (FP8_E5M2, FP8_E4M3)
    ladder = {"mxfp4_fprop": (1, 0, 0), "mxfp4_fprop_dgrad": (1, 1, 0), "mxfp4_all": (1, 1, 1)}
    for name, on in ladder.items():
        p = policies.get(name)
        for gemm, quantized in zip(("fprop", "dgrad", "wgrad"), on):
            r = getattr(p, gemm)
            assert r == (GemmRecipe(lhs=mx_even, rhs=mx_even) if quantized else pt), (name, gemm)
    h16 = policies.get("mxfp4_all_h16")
    for r in h16.gemms.values():
        assert r.lhs == mx_even and r.rhs == mx_even
        assert r.hadamard == Hadamard(block_size=16, randomized=False, seed=None)
    assert not h16.needs_key
    assert all(r.hadamard.block_size == 32 for r in policies.get("mxfp4_all_h32").gemms.values())
    wg = policies.get("mxfp4_all_h16_wgrad")
    assert wg.fprop.hadamard is None and wg.dgrad.hadamard is None
    assert wg.wgrad.hadamard == Hadamard(block_size=16)
    sr = policies.get("mxfp4_all_sr")
    assert sr.fprop.lhs.rounding is Rounding.NEAREST_EVEN and sr.needs_key
    assert all(getattr(sr, g).lhs.rounding is Rounding.STOCHASTIC for g in ("dgrad", "wgrad"))
    rht = policies.get("mxfp4_all_rht16")
    assert all(r.hadamard == Hadamard(block_size=16, randomized=True) for r in rht.gemms.values())
    nv = policies.get("nvfp4")
    assert all(r.lhs.fmt is NVFP4 and r.rhs.fmt is NVFP4 for r in nv.gemms.values())
    assert nv.fprop.lhs.rounding is Rounding.NEAREST_EVEN
    assert nv.dgrad.lhs.rounding is Rounding.STOCHASTIC
    assert nv.wgrad.lhs.rounding is Rounding.STOCHASTIC
    assert nv.dgrad.rhs.rounding is Rounding.NEAREST_EVEN
    assert nv.wgrad.rhs.rounding is Rounding.NEAREST_EVEN
    assert nv.wgrad.hadamard == Hadamard(block_size=16, seed=0) and nv.fprop.hadamard is None
    nvfp4_doc = policies.PRESETS["nvfp4"].__doc__
    assert "16×16" in nvfp4_doc and "Not expressible" in nvfp4_doc
    ts = policies.get("tseng")
    assert ts.fprop.is_passthrough
    for r in (ts.dgrad, ts.wgrad):
        assert r.hadamard == Hadamard(block_size=64, randomized=True)
        for o in (r.lhs, r.rhs):
            assert o.fmt is MXFP4 and o.rounding is Rounding.STOCHASTIC and o.sr_prescale


# ----------------------------------------------------------------------------- dict I/O
def test_from_dict_accepts_short_forms_and_rejects_unknown_keys():
    d = {"fprop": {"lhs": "mxfp4", "rhs": {"fmt": "mxfp4", "scale_rule": "even"}, "hadamard": 16},
         "dgrad": {"lhs": "bf16", "rhs": "bf16"},
         "wgrad": {"lhs": "bf16", "rhs": "bf16", "hadamard": {"block_size": 32}}}
    p = policies.from_dict(d)
    assert p.fprop.lhs == OperandRecipe(fmt=MXFP4) and p.fprop.rhs.scale_rule is ScaleRule.EVEN
    assert p.fprop.hadamard == Hadamard(block_size=16) and p.wgrad.hadamard.block_size == 32
    assert p.name is None
    assert policies.from_dict("mxfp4_all") == policies.get("mxfp4_all")
    with pytest.raises(ValueError, match="unknown keys"):
        policies.from_dict({**d, "extra": 1})
    # an omitted GEMM is pass-through, as in Python (tests/mxjax/test_policy_dict_forms.py)
    assert policies.from_dict({"fprop": d["fprop"], "dgrad": d["dgrad"]}).wgrad.is_passthrough
    with pytest.raises(ValueError, match=r"fprop: missing keys \['rhs'\]"):
        policies.from_dict({**d, "fprop": {"lhs": "mxfp4"}})
    with pytest.raises(ValueError, match="unknown keys"):
        policies.from_dict({**d, "fprop": {"lhs": "mxfp4", "rhs": "mxfp4", "hadmard": 16}})
    with pytest.raises(ValueError, match="unknown format"):
        policies.from_dict({**d, "fprop": {"lhs": "fp4", "rhs": "mxfp4"}})


def test_describe_shows_each_operand():
    text = policies.get("nvfp4").describe()
    assert "needs a PRNG key" in text
    assert "dY: nvfp4 stochastic" in text and "H16 (fixed signs, seed 0)" in text
    assert "X: bf16 (pass-through)" in policies.get("tseng").describe()
    assert F.get("mxfp4") is MXFP4


def test_check_keys_is_public_and_takes_the_error_type():
    class ConfErr(ValueError):
        pass

    with pytest.raises(ConfErr, match=r"x: unknown keys \['b'\]; allowed: \['a'\]"):
        check_keys({"a": 1, "b": 2}, {"a"}, where="x", error=ConfErr)
    with pytest.raises(ValueError, match=r"x: missing keys \['a'\]"):
        check_keys({}, {"a"}, {"a"}, where="x")
    with pytest.raises(TypeError, match="x: expected a mapping"):
        check_keys([1], {"a"}, where="x")
    assert check_keys({"a": 1}, {"a"}, {"a"}, where="x") == {"a": 1}
