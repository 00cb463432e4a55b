"""The optimizer: ``optax.chain(clip_by_global_norm, adamw)`` with warmup + cosine.

Weight decay is masked off norm scales and 1-D parameters. The schedule is
indexed by the number of *applied* updates (steps skipped by the non-finite
guard do not advance it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from train.config import Config

Schedule = Callable[[jax.Array], jax.Array]


def lr_schedule(config: Config) -> Schedule:
    """Linear warmup to lr over warmup_steps (step 0 gets lr/warmup), then cosine to
    final_lr_ratio*lr at decay_steps, constant after."""
    o = config.optim
    lr, w, total, fin = o.lr, o.warmup_steps, config.decay_steps, o.final_lr_ratio

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        warm = lr * (c + 1.0) / max(1, w)
        prog = jnp.clip((c - w) / max(1, total - w), 0.0, 1.0)
        cos = lr * (fin + (1.0 - fin) * 0.5 * (1.0 + jnp.cos(jnp.pi * prog)))
        return jnp.where(c < w, warm, cos)

    return schedule


def decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay: everything but norm scales and 1-D params."""
    def keep(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        return x.ndim >= 2 and not any("norm" in n for n in names)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config: Config) -> tuple[optax.GradientTransformation, Schedule]:
    """(the optax transformation, its learning-rate schedule) for ``config.optim``."""
    o = config.optim
    sched = lr_schedule(config)
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                    mask=decay_mask),
    )
    return tx, sched
