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


# --- backend: auto by default; another backend puts every quantized GEMM on it ----------


def _no_backends(d):
    return {k: ({f: x for f, x in v.items() if f != "backend"} if isinstance(v, dict) else v)
            for k, v in d.items()}


@pytest.mark.parametrize("spec, auto_gemms, name", [
    ("mxfp4_all_h16", {"fprop", "dgrad", "wgrad"}, "mxfp4_all_h16"),
    ("mxfp4_fprop", {"fprop"}, "mxfp4_fprop"),  # pass-through GEMMs stay as they are
    ("fp8", {"fprop", "dgrad", "wgrad"}, "fp8"),
    ("mxfp4_all_h16@xla", set(), "mxfp4_all_h16@xla"),  # a named backend stays
    ({**policies.to_dict(H16), "name": "mine"}, set(), "mine"),  # a dict's stated backends
    ({**_no_backends(policies.to_dict(H16)), "name": "mine"}, {"fprop", "dgrad", "wgrad"},
     "mine"),
])
def test_backend_auto_is_the_default_where_the_policy_names_none(spec, auto_gemms, name):
    cfg = C.from_dict({"policy": spec})
    assert cfg.backend == "auto" and C.from_dict(cfg.to_dict()) == cfg
    pol, got_name, record = plan_mod.resolve_policy(cfg.policy, cfg.backend)
    base = plan_mod.resolve_policy(spec, None)[0]
    assert got_name == name
    for gemm, recipe in pol.gemms.items():
        want = base.gemms[gemm]
        assert recipe.backend == ("auto" if gemm in auto_gemms else want.backend), gemm
        assert dataclasses.replace(recipe, backend=want.backend) == want  # nothing else
    assert policies.from_dict(record) == pol
    # on this CPU, 'auto' is the emulation: every GEMM's route is 'xla' (or pass-through)
    assert set(pol.routes().values()) <= {"cpu", "xla", "passthrough"}


@pytest.mark.parametrize("spec", ["mxfp4_all_h16", "fp8", "mxfp4_all_h16@xla",
                                  {**policies.to_dict(H16), "name": "mine"}])
def test_another_backend_puts_every_quantized_gemm_on_it(spec):
    base = plan_mod.resolve_policy(spec, None)[0]
    got = plan_mod.with_backend(base, "xla_fp8")
    for gemm, recipe in got.gemms.items():
        want = base.gemms[gemm]
        assert recipe.backend == ("xla_fp8" if not want.is_passthrough else want.backend)
    pol, name, _ = plan_mod.resolve_policy(spec, "xla")
    assert all(r.backend == "xla" for r in pol.gemms.values() if not r.is_passthrough)
    assert name.endswith("@xla") and "@" not in name[:-len("@xla")]


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


@pytest.mark.parametrize("backend", ["xla_fp4", "xla_fp8"])
def test_a_backend_that_gives_no_speedup_on_the_chip_is_refused(backend):
    # On a CPU the FP8/FP4 routes run XLA:CPU's expansion of their dots: the same values as
    # the emulation, slower. Training refuses them, naming the chip and what to use.
    cfg = C.from_dict({"policy": "mxfp4_all_h16", "backend": backend})
    with pytest.raises(ConfigError) as e:
        plan_mod.resolve_policy(cfg.policy, cfg.backend)
    msg = str(e.value)
    assert msg.startswith(f"policy.fprop.backend: backend {backend!r} gives no speed-up on "
                          "'cpu'"), msg
    assert "Use backend 'auto' (the chip's fastest exact route) or 'xla' here" in msg
    with pytest.raises(ConfigError, match="gives no speed-up"):
        plan_mod.resolve_policy(f"mxfp4_all_h16@{backend}", "auto")  # named: the same


def test_compiled_run_compiles_every_policy_on_the_config_backend():
    """`CompiledRun.policy_for` (used by its train and eval steps, so by the trainer and the
    ladder study's runs): the config's backend applied to whatever policy it is given."""
    import types

    from train.run import CompiledRun

    no_plan = types.SimpleNamespace(policy=None)  # a run of another policy than these
    run = types.SimpleNamespace(config=C.from_dict({"backend": "xla_fp8"}), plan=no_plan)
    got = CompiledRun.policy_for(run, H16)
    assert got == H16.with_backend("xla_fp8") and got.name == "mxfp4_all_h16@xla_fp8"
    assert CompiledRun.policy_for(run, None) is None
    default = types.SimpleNamespace(config=C.from_dict({}), plan=no_plan)
    got = CompiledRun.policy_for(default, H16)
    assert got == H16.with_backend("auto") and got.name == "mxfp4_all_h16"
    plain = types.SimpleNamespace(config=C.from_dict({"backend": None}), plan=no_plan)
    assert CompiledRun.policy_for(plain, H16) is H16


def test_a_run_moved_to_another_backend_resumes_its_checkpoints():
    saved = plan_mod.resolve_policy("mxfp4_all_h16")[2]  # written under the emulation
    moved = plan_mod.resolve_policy("mxfp4_all_h16", "auto")[2]
    compat.check_compatible({"compat": {"policy": saved}}, {"policy": moved}, ".", "x")


# --- the command line: --policy takes what resolve takes; --list-policies -----------------


def test_list_policies_prints_one_line_per_preset(capsys):
    from train.__main__ import main

    assert main(["--list-policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["none", *policies.names()]
    for ln, name in zip(lines[1:], policies.names(), strict=True):
        assert ln.split(None, 1)[1] == policies.summary(name) != ""
    assert "deterministic H16 on every operand of all three GEMMs" in lines[
        1 + policies.names().index("mxfp4_all_h16")]


@pytest.mark.parametrize("text, want", [
    ("mxfp4_all_h16", "mxfp4_all_h16"),
    ("mxfp4_all_h16@xla", "mxfp4_all_h16@xla"),
    ("{fprop: mxfp4, dgrad: null}", {"fprop": "mxfp4", "dgrad": None}),
    ('{"name": "mine", "fprop": "mxfp4"}', {"name": "mine", "fprop": "mxfp4"}),
])
def test_policy_argument_takes_names_and_dicts(text, want):
    assert C.policy_argument(text) == want
    assert plan_mod.resolve_policy(C.from_dict({"policy": want}).policy) is not None


def test_policy_argument_that_does_not_parse_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--policy: '\{fprop: mxfp4' is not a JSON/YAML "
                                          r"mapping .*quote it whole in the shell"):
        C.policy_argument("{fprop: mxfp4")


def test_cli_policy_dict_reaches_the_run(tmp_path, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    args = ["--policy", "{name: mine, fprop: mxfp4}", "--out", str(out), "--print-config"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    import yaml

    assert yaml.safe_load(printed)["policy"] == {"name": "mine", "fprop": "mxfp4"}


@pytest.mark.parametrize("spec", [
    "mxfp4_all_h16@xla",
    {"name": "mine", "fprop": {"lhs": "mxfp4", "rhs": "mxfp4", "backend": "xla"}},
])
def test_the_compiled_policy_keeps_the_backend_the_entry_names(spec):
    """`backend: auto` leaves a GEMM whose backend the policy entry names; the run compiles
    `CompiledRun.policy_for(plan.policy)`, which once applied 'auto' again and moved those
    GEMMs off the 'xla' they asked for (on a GPU: onto the FP8/FP4 route, the route record
    still saying 'xla')."""
    from types import SimpleNamespace

    from train.run import CompiledRun

    pol = plan_mod.resolve_policy(spec, "auto")[0]
    assert pol.fprop.backend == "xla"
    run = SimpleNamespace(plan=SimpleNamespace(policy=pol), config=SimpleNamespace(backend="auto"))
    assert CompiledRun.policy_for(run, pol) == pol
    # a rung named '<name>@xla' (the study's) keeps it too; a preset as written goes 'auto'
    assert plan_mod.with_backend(policies.get("mxfp4_all_h16@xla"), "auto").fprop.backend == "xla"
    assert plan_mod.with_backend(H16, "auto").fprop.backend == "auto"
