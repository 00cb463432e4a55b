"""The train config's ``policy:`` takes what ``mxjax.policies.resolve`` takes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mxjax import policies
from train import compat
from train import config as C
from train import plan as plan_mod
from train.config import ConfigError

H16 = policies.get("mxfp4_all_h16")


@pytest.mark.parametrize("spec, want, name", [
    ("mxfp4_all_h16", H16, "mxfp4_all_h16"),
    ({**policies.to_dict(H16), "name": "mine"}, H16, "mine"),
    (H16.replace(fprop=None, name="mine"), H16.replace(fprop=None), "mine"),
    (H16.replace(fprop=None), H16.replace(fprop=None), "custom"),
    ("none", None, "none"),
    (None, None, "none"),
])
def test_policy_takes_every_form_resolve_takes(spec, want, name):
    cfg = C.from_dict({"policy": spec})
    json.dumps(cfg.to_dict())  # a PrecisionPolicy is stored as its dict: config.yaml-safe
    assert C.from_dict(cfg.to_dict()) == cfg
    pol, got_name, record = plan_mod.resolve_policy(cfg.policy)
    assert pol == want and got_name == name
    if want is None:
        assert record is None
    else:
        assert policies.from_dict(record) == want and record["name"] == pol.name


def test_bad_policy_specs_name_the_key():
    with pytest.raises(ConfigError, match=r"policy: expected str \| mapping \| null"):
        C.from_dict({"policy": 3})
    with pytest.raises(ConfigError, match=r"policy: invalid policy dict"):
        plan_mod.resolve_policy(C.from_dict({"policy": {"fprop": 1}}).policy)


def test_a_renamed_preset_resumes_the_runs_of_its_old_name():
    with pytest.warns(DeprecationWarning, match="use 'mxfp4_all_h16_wgrad'"):
        old = plan_mod.resolve_policy("mxfp4_wgrad_h16")[2]
    new = plan_mod.resolve_policy("mxfp4_all_h16_wgrad")[2]
    assert old == new  # the same recipes under the new name
    saved = {**new, "name": "mxfp4_wgrad_h16"}  # a checkpoint written before the rename
    compat.check_compatible({"compat": {"policy": saved}}, {"policy": new}, ".", "x")
    with pytest.raises(Exception, match="policy"):
        compat.check_compatible({"compat": {"policy": saved}},
                                {"policy": plan_mod.resolve_policy("mxfp4_all")[2]}, ".", "x")


# --- backend: every quantized GEMM of every policy a run compiles on one backend ----------


@pytest.mark.parametrize("spec", ["mxfp4_all_h16", "fp8", "mxfp4_all_h16@xla",
                                  {**policies.to_dict(H16), "name": "mine"}])
def test_backend_puts_every_quantized_gemm_of_the_policy_on_it(spec):
    cfg = C.from_dict({"policy": spec, "backend": "auto"})
    assert C.from_dict(cfg.to_dict()) == cfg
    pol, name, record = plan_mod.resolve_policy(cfg.policy, cfg.backend)
    base = plan_mod.resolve_policy(spec)[0]
    for gemm, recipe in pol.gemms.items():
        want = base.gemms[gemm]
        assert recipe.backend == ("auto" if not want.is_passthrough else want.backend)
        assert dataclasses.replace(recipe, backend=want.backend) == want  # nothing else
    assert name.endswith("@auto") and "@" not in name[:-len("@auto")]
    assert policies.from_dict(record) == pol


def test_backend_null_keeps_the_policy_and_none_stays_none():
    assert plan_mod.resolve_policy("mxfp4_all_h16", None)[0] == H16
    assert plan_mod.resolve_policy(None, "auto") == (None, "none", None)
    assert plan_mod.with_backend(None, "auto") is None


def test_bad_backend_names_the_key():
    with pytest.raises(ConfigError, match=r"backend: expected one of xla, .*auto or null, "
                                          r"got 'fp4'"):
        C.from_dict({"policy": "mxfp4_all_h16", "backend": "fp4"})
    with pytest.raises(ConfigError, match=r"backend: expected"):
        plan_mod.with_backend(H16, "fp4")


def test_compiled_run_compiles_every_policy_on_the_config_backend():
    """`CompiledRun.policy_for` (used by its train and eval steps, so by the trainer and the
    ladder study's runs): the config's backend applied to whatever policy it is given."""
    import types

    from train.run import CompiledRun

    run = types.SimpleNamespace(config=C.from_dict({"backend": "xla_fp8"}))
    got = CompiledRun.policy_for(run, H16)
    assert got == H16.with_backend("xla_fp8") and got.name == "mxfp4_all_h16@xla_fp8"
    assert CompiledRun.policy_for(run, None) is None
    plain = types.SimpleNamespace(config=C.from_dict({}))
    assert CompiledRun.policy_for(plain, H16) is H16


def test_a_run_moved_to_another_backend_resumes_its_checkpoints():
    saved = plan_mod.resolve_policy("mxfp4_all_h16")[2]  # written under the emulation
    moved = plan_mod.resolve_policy("mxfp4_all_h16", "auto")[2]
    compat.check_compatible({"compat": {"policy": saved}}, {"policy": moved}, ".", "x")
