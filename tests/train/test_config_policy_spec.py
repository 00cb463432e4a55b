"""The train config's ``policy:`` takes what ``mxjax.policies.resolve`` takes (issue 37 item 8)."""

from __future__ import annotations

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
