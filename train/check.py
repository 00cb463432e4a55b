"""``python -m train --check``: what a run would need and what it would refuse, compiling
nothing.

`check` answers in the order a newcomer asks, each part on its own so that one missing
piece does not hide the others:

1. **memory**, from the model, the mesh and the micro-batch alone (no data file or
   tokenizer is read): the estimate per device (`train.memory`), whether it fits the
   devices (`train.devices`: this host's, or ``--devices N --chip NAME`` for hardware the
   host lacks) and the smallest ``mesh.fsdp`` that fits; beside it, what each GEMM of the
   policy runs on there (`train.backend.route_record`);
2. **the output directory**, which the run takes before anything else: an ``--out`` that
   is (or lies under) a file (exit 2), or one the run could not take (exit 5: not
   writable, a file where the checkpoints go, files that no run wrote;
   `train.run_lock.check_usable`, nothing created);
3. **everything else the run validates** (`train.plan.validate`: data files, tokenizer,
   policy, batch sizes), its data prepared as the run would;
4. **the checkpoints in** ``--out``: what the run would refuse there
   (`train.compat.check_run_dir`, the comparison the run itself makes).

Each problem is a `Finding`: the line the run prints for it and the run's exit code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mxjax.backends import Capabilities, capabilities_for
from mxjax.chips import Chip, compute_capability_of
from train import backend as backend_mod
from train import compat, memory, run_lock
from train import devices as devmod
from train import plan as plan_mod
from train.checkpoint import CheckpointError, CheckpointWriteError
from train.config import Config, ConfigError
from train.data import DataError
from train.output.summary import finished

__all__ = ["Finding", "check"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """A problem `check` found: ``line`` as the run prints it on stderr (``config error:
    ...``) and the ``exit_code`` the run would end with (2 config, 4 checkpoint, ...)."""

    line: str
    exit_code: int


def _finding(e: Exception) -> Finding:
    """The run's report of `e` (train.__main__'s mapping of errors to exit codes)."""
    if isinstance(e, ConfigError):
        return Finding(line=f"config error: {e}", exit_code=2)
    if isinstance(e, CheckpointWriteError):
        return Finding(line=f"checkpoint write error: {e}", exit_code=6)
    if isinstance(e, CheckpointError):
        return Finding(line=f"checkpoint error: {e}", exit_code=4)
    if isinstance(e, DataError):
        return Finding(line=f"data error: {e}", exit_code=7)
    return Finding(line=f"I/O error: {e}", exit_code=6)


def _memory(cfg: Config, target: devmod.DeviceTarget) -> tuple[dict[str, Any], Finding | None]:
    """The memory part of the report, from the config alone (ConfigError for a bad model,
    mesh or batch section)."""
    mc, vocab_note = plan_mod.nominal_model_config(cfg)
    mesh = plan_mod.resolve_mesh(cfg, target.count)
    shape = memory.step_shape(cfg, mc, mesh, target.platform)
    est = shape.estimate()
    out: dict[str, Any] = {
        "devices": {"count": target.count, "chip": target.chip or "this host's",
                    "platform": target.platform},
        "mesh": dict(zip(("data", "fsdp", "tensor"), mesh, strict=True)),
        "accum_steps": shape.accum_steps, "n_params": est.n_params,
        "memory_per_device": est.as_dict(), "device_memory": target.source,
        # null when the device's memory is unknown: nothing to compare the estimate with
        "fits": None if target.budget is None else est.total <= target.budget}
    if vocab_note:
        out["memory_note"] = vocab_note
    if target.budget is not None:
        out["smallest_fsdp"] = memory.fsdp_sentence(shape, target.budget)
    too_big = memory.over_budget(shape, target.budget, target.source)
    return out, None if too_big is None else Finding(line=f"config error: memory: {too_big}",
                                                     exit_code=2)


def _chip_capabilities(target: devmod.DeviceTarget) -> Capabilities | None:
    """The capabilities of ``--chip``'s chip (None: this host's, the chip compiled for)."""
    if target.chip is None:
        return None
    kind = devmod.CHIPS[target.chip].device_kind
    return capabilities_for(Chip(platform=target.platform, device_kind=kind,
                                 compute_capability=compute_capability_of(kind)))


def _routes(cfg: Config, caps: Capabilities | None) -> dict[str, Any] | None:
    """What each GEMM of the config's policy runs on, on the chip of ``caps`` (None: this
    host's), from the config alone (`train.backend.route_record`); None when the policy or
    its backend is refused (the validation's finding says why)."""
    try:
        policy, _, _ = plan_mod.resolve_policy(cfg.policy, cfg.backend, caps=caps)
    except ConfigError:
        return None
    return backend_mod.route_record(policy, cfg.backend, caps=caps)


def _run_dir(cfg: Config) -> Finding | None:
    """What the run would refuse in its output directory before anything else
    (`train.run_lock.check_usable`: not writable, a file where the checkpoints go, files no
    run wrote), as the run reports it (exit 5); None for a usable one, or a finished run's
    that it cannot write (the run then only reports its result)."""
    try:
        run_lock.check_usable(cfg.out_path)
    except run_lock.RunDirNotWritable as e:
        if finished(cfg.out_path, cfg.train.steps):
            return None
        return Finding(line=f"output directory error: {e}", exit_code=5)
    except run_lock.RunLockError as e:
        return Finding(line=f"output directory error: {e}", exit_code=5)
    return None


def check(cfg: Config, *, devices: int | None = None, chip: str | None = None,
          verbose: bool = True) -> tuple[dict[str, Any], list[Finding]]:
    """(the JSON report, the findings in the order the run would meet them) for `cfg` on
    `devices` devices of `chip` (None: this host's). The exit code of ``--check`` is the
    first finding's (0 without one). A ConfigError is raised only for bad ``--devices`` /
    ``--chip`` values."""
    target = devmod.target(devices, chip)
    caps = _chip_capabilities(target)  # backends are judged, and routed, on that chip
    report: dict[str, Any] = {"ok": True, "out_dir": str(cfg.out_path)}
    run_findings: list[Finding] = []
    memory_finding = None
    try:
        part, memory_finding = _memory(cfg, target)
        report.update(part)
    except ConfigError as e:  # no estimate without a model and a mesh: the run's refusal
        run_findings.append(_finding(e))
    else:  # what each GEMM runs on there, also without data (validate names it again)
        routes = _routes(cfg, caps)
        if routes is not None:
            report["routes"] = routes
    run_dir = None
    if not run_findings:
        try:
            plan_mod.check_out_dir(cfg.out_path)
        except ConfigError as e:
            run_findings.append(_finding(e))
        else:
            run_dir = _run_dir(cfg)
            run_findings += [run_dir] if run_dir else []
    if not run_findings or run_dir:
        try:
            plan = plan_mod.validate(cfg, verbose=verbose, n_devices=target.count, caps=caps)
        except (ConfigError, DataError, OSError) as e:
            run_findings.append(_finding(e))
        else:
            report.update({"policy": plan.policy_name, **plan_mod.data_facts(plan),
                           "eval_batch": plan.eval_batch,
                           "routes": backend_mod.route_record(plan.policy, cfg.backend,
                                                              caps=caps)})
            if run_dir is None:  # the run stops at its directory before its checkpoints
                try:
                    report["resumes_from_step"] = compat.check_run_dir(plan)
                except (ConfigError, CheckpointError, OSError) as e:
                    run_findings.append(_finding(e))
    findings = run_findings + ([memory_finding] if memory_finding else [])
    report["ok"] = not findings
    if findings:
        report["problems"] = [f.line for f in findings]
    return report, findings
