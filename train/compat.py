"""Which checkpoints a run may resume: the run's fingerprint and the comparison."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.checkpoint import Checkpointer, IncompatibleCheckpointError
from train.config import ConfigError
from train.data import stream as stream_data
from train.execution import STATELESS_MODEL_FIELDS
from train.jsonsafe import jsonable
from train.plan import Plan


def fingerprint(plan: Plan) -> dict[str, Any]:
    """The parts of a run a checkpoint must agree with to be resumed (stored in its meta)."""
    c = plan.config
    if plan.stream is None:
        data = {"fingerprint": plan.prepared.meta["fingerprint"]["hash"],
                "seq_len": c.data.seq_len}
    else:  # the stream's order depends on its settings and on the number of processes
        import jax

        data = stream_data.stream_fingerprint(c.data, jax.process_count())
    init = {"init_from": c.model.init_from} if c.model.init_from is not None else {}
    return {
        **init,  # only when set: checkpoints of runs without it stay resumable
        "model": jsonable(plan.model_config),
        "policy": plan.policy_record,
        "data": data,
        "seed": c.seed,
        "optim": {**jsonable(c.optim), "decay_steps": c.decay_steps},
        "global_batch": c.train.global_batch,
        # what defines the eval history: the validation set (data, seq_len above) and its size
        "eval": {"eval_sequences": c.train.eval_sequences},
    }


def _comparable(key: str, value: Any) -> Any:
    """A fingerprint entry as compared: a policy without its name and its GEMMs' backends (a
    policy is its recipes: a renamed preset, e.g. mxfp4_wgrad_h16 -> mxfp4_all_h16_wgrad,
    resumes its runs, and so does a run moved to another backend, which computes the same
    GEMMs: docs/NUMERICS.md); a model without the fields that hold no state
    (`train.execution.STATELESS_MODEL_FIELDS`: remat, the attention form, the sequence bound),
    so that the out-of-memory advice ``model.overrides.remat=true`` resumes a run."""
    if key == "model" and isinstance(value, Mapping):
        return {k: v for k, v in value.items() if k not in STATELESS_MODEL_FIELDS}
    if key == "policy" and isinstance(value, Mapping):
        return {k: ({f: x for f, x in v.items() if f != "backend"} if isinstance(v, Mapping)
                    else v) for k, v in value.items() if k != "name"}
    if key == "data" and isinstance(value, Mapping):  # its "files" are compared on their own
        return {k: v for k, v in value.items() if k != "files"}
    return value


def _data_file_changes(old: Any, new: Any) -> list[str]:
    """The grain sources' changes ("sources: added x; changed y ..."), when both fingerprints
    list their files (checkpoints written before the listing existed are compared by names
    and sizes only)."""
    of = old.get("files") if isinstance(old, Mapping) else None
    nf = new.get("files") if isinstance(new, Mapping) else None
    if not isinstance(of, Mapping) or not isinstance(nf, Mapping):
        return []
    out = []
    for key in ("sources", "val_sources"):
        changes = stream_data.file_changes(of.get(key, []), nf.get(key, []))
        if changes:
            out.append(f"data.{key}: " + "; ".join(changes))
    return out


def check_compatible(meta: Mapping[str, Any], want: Mapping[str, Any], where: Path,
                     policy_name: str) -> None:
    """Raise IncompatibleCheckpointError listing what differs between a checkpoint's
    ``meta['compat']`` and this run's `fingerprint` (`want`)."""
    have = meta.get("compat", {})
    files = _data_file_changes(have.get("data"), want.get("data"))
    diffs = [k for k, v in want.items()
             if _comparable(k, have.get(k)) != _comparable(k, v) or (k == "data" and files)]
    if not diffs:
        return
    lines = []
    for k in diffs:
        old, new = _comparable(k, have.get(k)), _comparable(k, want[k])
        if k == "data" and files:
            shown = {"sources", "n_sources", "val_sources"}  # what the file changes explain
            sub = sorted(s for s in set(old) | set(new)
                         if old.get(s) != new.get(s) and s not in shown)
            detail = "; ".join(files + [f"{s}: {old.get(s)!r} -> {new.get(s)!r}"
                                        for s in sub[:4]])
        elif isinstance(old, Mapping) and isinstance(new, Mapping):
            sub = sorted(s for s in set(old) | set(new) if old.get(s) != new.get(s))
            detail = ", ".join(f"{s}: {old.get(s)!r} -> {new.get(s)!r}" for s in sub[:4])
        else:
            detail = f"{old!r} -> {new!r}"
        if k == "policy":
            detail = f"checkpoint {meta.get('policy_name')!r}, this run {policy_name!r}"
        lines.append(f"  {k}: {detail[:1200 if k == 'data' and files else 300]}")
        if k == "optim" and old.get("decay_steps") != new.get("decay_steps"):
            lines.append(f"  (optim.decay_steps defaults to train.steps; to train longer on the "
                         f"old schedule set optim.decay_steps={old.get('decay_steps')})")
        if k == "eval":
            lines.append("  (resuming would put evaluations on two validation sets in one "
                         "history; keep the old train.* eval settings or start a new --out)")
        if k == "data" and files:
            lines.append("  (the stream's position in the checkpoint is a shard and line of "
                         "those files: put them back as they were, with the same names and "
                         "contents, and run the same command again; to go on training on the "
                         "changed files, export this run's weights (python -m train export-hf "
                         "RUN_DIR HF_DIR) and start a new --out with --set "
                         "model.init_from=HF_DIR)")
    raise IncompatibleCheckpointError(
        f"the checkpoints in {where} were written by a different run setup and cannot be "
        f"resumed:\n" + "\n".join(lines) + "\nUse another output directory (--out) or delete "
        f"{where} to start over.")


def latest_resumable(ckpt: Checkpointer, want: Mapping[str, Any],
                     policy_name: str) -> tuple[int, dict[str, Any]] | None:
    """(step, record) of the checkpoint a run resumes from, once it agrees with the run's
    `fingerprint` (`want`); None when there is none. What a run refuses: a damaged or
    unreadable checkpoint (CorruptCheckpointError), one of an older record format or of
    another setup (IncompatibleCheckpointError, `check_compatible`); all exit 4. The run
    and ``--check`` both ask here."""
    latest = ckpt.latest_step()
    if latest is None:
        return None
    meta = ckpt.read_meta(latest)
    check_compatible(meta, want, ckpt.directory, policy_name)
    return latest, meta


def refuse_checkpoints_when_disabled(config) -> None:
    """A ConfigError when ``checkpoint.enabled`` is false but the run directory holds
    checkpoints of an earlier run (which the run would overwrite)."""
    d = config.out_path / "checkpoints"
    if not config.checkpoint.enabled and d.is_dir() and any(d.iterdir()):
        raise ConfigError(f"checkpoint.enabled is false but {config.out_path}/checkpoints holds "
                          "checkpoints of an earlier run; use another output directory "
                          "(--out) rather than overwrite it")


def check_run_dir(plan: Plan) -> int | None:
    """What the run of `plan` would refuse in its output directory, raised as the run raises
    it (`refuse_checkpoints_when_disabled`, `latest_resumable`), without writing anything;
    else the checkpoint step it would resume from (None: it starts fresh)."""
    c = plan.config
    refuse_checkpoints_when_disabled(c)
    d = c.out_path / "checkpoints"
    if not c.checkpoint.enabled or not d.is_dir():
        return None
    with Checkpointer(d, keep=c.checkpoint.keep, async_save=False, read_only=True) as ck:
        found = latest_resumable(ck, fingerprint(plan), plan.policy_name)
    return None if found is None else found[0]
