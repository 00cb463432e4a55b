"""How a run's steps are executed, as opposed to what they compute: the settings a resumed
run may change.

A checkpoint holds the state (parameters, optimizer moments, step, data position); the
settings below change none of it, only how a step is laid out on the devices or how much
memory it takes, so a run may resume under new values (`train.compat` leaves them out of
the comparison). Most of them change the order of floating-point sums (a micro-batch
accumulates its gradients in another grouping, a mesh reduces over other devices, an eval
batch sums its losses in other groups), so the continuation is no longer bit-identical to an
uninterrupted run, though it agrees to about 1e-6 relative: `changes` names what differs so
the trainer can say so when it resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["STATELESS_MODEL_FIELDS", "changes", "record"]

# LlamaConfig fields that hold no state: recomputing the blocks in the backward pass
# (remat) and what the recomputation keeps (remat_policy), the form of the attention
# computation, and the longest sequence the model accepts (a bound, no weight).
STATELESS_MODEL_FIELDS = ("remat", "remat_policy", "attention_impl", "max_seq_len")

# The settings `record` keeps, in the order `changes` names them; max_seq_len is left out
# (it changes no value a step computes).
_NAMES = {"micro_batch": "train.micro_batch", "eval_batch": "train.eval_batch",
          "mesh": "mesh (data, fsdp, tensor)", "devices": "device count",
          "remat": "model.overrides.remat", "remat_policy": "model.overrides.remat_policy",
          "attention_impl": "model.overrides.attention_impl"}


def record(plan: Any, device_count: int) -> dict[str, Any]:
    """The execution settings of a validated `train.plan.Plan` on `device_count` devices
    (stored in each checkpoint's meta as ``execution``)."""
    c, mc = plan.config, plan.model_config
    return {"micro_batch": c.train.micro_batch or c.train.global_batch,
            "eval_batch": plan.eval_batch, "mesh": list(plan.mesh_axes),
            "devices": device_count, "remat": bool(mc.remat),
            "remat_policy": mc.remat_policy, "attention_impl": mc.attention_impl}


def _from_old_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint written before ``execution`` was recorded tells of it: the batch
    sizes from its config, remat and the attention form from its model record."""
    cfg = meta.get("config") or {}
    t = cfg.get("train") or {}
    model = (meta.get("compat") or {}).get("model") or {}
    out: dict[str, Any] = {}
    if isinstance(t.get("global_batch"), int):
        micro = t.get("micro_batch") or t["global_batch"]
        out["micro_batch"] = micro
        if isinstance(t.get("eval_sequences"), int):
            out["eval_batch"] = t.get("eval_batch") or min(micro, t["eval_sequences"])
    for k in ("remat", "attention_impl"):
        if k in model:
            out[k] = model[k]
    return out


def changes(meta: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``setting: old -> new`` for each execution setting of the checkpoint (its ``meta``)
    that differs from this run's `record` ``now``; those a checkpoint does not record are
    not compared."""
    old = meta.get("execution")
    if not isinstance(old, Mapping):
        old = _from_old_meta(meta)
    return [f"{_NAMES[k]}: {_show(old[k])} -> {_show(now[k])}" for k in _NAMES
            if k in old and k in now and old[k] != now[k]]


def _show(v: Any) -> str:
    return "x".join(map(str, v)) if isinstance(v, list) else repr(v)
