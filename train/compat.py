"""Which checkpoints a run may resume: the run's fingerprint and the comparison."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.checkpoint import IncompatibleCheckpointError
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
    return value


def check_compatible(meta: Mapping[str, Any], want: Mapping[str, Any], where: Path,
                     policy_name: str) -> None:
    """Raise IncompatibleCheckpointError listing what differs between a checkpoint's
    ``meta['compat']`` and this run's `fingerprint` (`want`)."""
    have = meta.get("compat", {})
    diffs = [k for k, v in want.items() if _comparable(k, have.get(k)) != _comparable(k, v)]
    if not diffs:
        return
    lines = []
    for k in diffs:
        old, new = have.get(k), want[k]
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            sub = sorted(s for s in set(old) | set(new) if old.get(s) != new.get(s))
            detail = ", ".join(f"{s}: {old.get(s)!r} -> {new.get(s)!r}" for s in sub[:4])
        else:
            detail = f"{old!r} -> {new!r}"
        if k == "policy":
            detail = f"checkpoint {meta.get('policy_name')!r}, this run {policy_name!r}"
        lines.append(f"  {k}: {detail[:300]}")
        if k == "optim" and old.get("decay_steps") != new.get("decay_steps"):
            lines.append(f"  (optim.decay_steps defaults to train.steps; to train longer on the "
                         f"old schedule set optim.decay_steps={old.get('decay_steps')})")
        if k == "eval":
            lines.append("  (resuming would put evaluations on two validation sets in one "
                         "history; keep the old train.* eval settings or start a new --out)")
    raise IncompatibleCheckpointError(
        f"the checkpoints in {where} were written by a different run setup and cannot be "
        f"resumed:\n" + "\n".join(lines) + "\nUse another output directory (--out) or delete "
        f"{where} to start over.")
