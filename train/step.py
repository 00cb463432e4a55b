"""The traced train and eval steps, as pure functions of (state, batch, key).

`make_train_step` returns ``step(state, batch int32[B, T+1], policy_base) ->
(state, metrics)``: forward/backward over ``accum_steps`` micro-batches
(``lax.scan``, grads summed in fp32 and averaged), one optimizer update, and a
non-finite guard: if the loss or the gradient norm is not finite, parameters
and optimizer state are left unchanged (the batch is consumed, the skip is
counted in ``state['skipped']`` and ``state['consecutive']``).

State: ``{'params': fp32 pure param dict, 'opt': optax state, 'step', 'skipped',
'consecutive': int32 scalars}``. Randomized policies get ``policy_key =
fold_in(policy_base, step)`` (and the micro-batch index folded in), so noise
differs per step and is the same on resume; eval uses the fixed key
``fold_in(policy_base, EVAL_STEP)``. Logits and the loss are fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mxjax import PrecisionPolicy, diagnostics
from train.hooks import Hooks, StepContext
from train.optimizer import Schedule

POLICY_TAG = 0x706F6C  # folded into the seed key for policy noise
EVAL_STEP = 2**31 - 1  # step index folded in for the (fixed) eval key

State = dict[str, Any]


def policy_base_key(seed: int) -> jax.Array:
    """The key every step's policy key is folded from."""
    return jax.random.fold_in(jax.random.key(seed), POLICY_TAG)


def _make_forward(graphdef: nnx.GraphDef, policy: PrecisionPolicy | None, hooks: Hooks):
    """``forward(params, tokens, key, step) -> (ce f32[b, T], aux)``."""
    def forward(params, tokens, key, step):
        model = nnx.merge(graphdef, params)
        pkey = key if (policy is not None and getattr(policy, "needs_key", False)) else None
        if hooks.forward is not None:
            logits, aux = hooks.forward(model, tokens[:, :-1], policy=policy, policy_key=pkey,
                                        step=step)
        else:
            logits, aux = model(tokens[:, :-1], policy=policy, policy_key=pkey), {}
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:])
        return ce, aux

    return forward


def make_train_step(*, graphdef: nnx.GraphDef, policy: PrecisionPolicy | None,
                    tx: optax.GradientTransformation, schedule: Schedule, accum_steps: int,
                    hooks: Hooks | None = None) -> Callable[..., tuple[State, dict[str, Any]]]:
    """The un-jitted train step (see the module docstring).

    metrics: loss, grad_norm (before clipping), lr (f32 scalars), finite (bool),
    skipped, consecutive (int32, after this step), and ``extra`` (the in_step
    hook's dict) when that hook is set.
    """
    hooks = hooks or Hooks()
    forward = _make_forward(graphdef, policy, hooks)

    def loss_fn(params, tokens, key, step):
        ce, aux = forward(params, tokens, key, step)
        return jnp.mean(ce), aux

    if hooks.diagnostics is not None:
        grad_fn = diagnostics.value_and_grad_with_stats(loss_fn, hooks.diagnostics)
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step_fn(state, batch, policy_base):
        params, step = state["params"], state["step"]
        key = jax.random.fold_in(policy_base, step)
        accum = accum_steps
        if accum == 1:
            (loss, aux), grads = grad_fn(params, batch, key, step)
        else:
            b, t1 = batch.shape
            micro = b // accum
            mb = batch.reshape(micro, accum, t1).swapaxes(0, 1)  # [accum, micro, T+1]
            aux_shape = jax.eval_shape(lambda: grad_fn(params, mb[0], key, step)[0][1])
            zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape))

            def body(carry, xs):
                i, tokens = xs
                (l, a), g = grad_fn(params, tokens, jax.random.fold_in(key, i), step)
                return (jax.tree.map(jnp.add, carry[0], g), carry[1] + l,
                        jax.tree.map(jnp.add, carry[2], a)), None

            (grads, loss, aux), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), mb))
            grads = jax.tree.map(lambda g: g / accum, grads)
            loss = loss / accum
            aux = jax.tree.map(lambda a: a / accum, aux)
        grad_norm = optax.tree.norm(grads)  # the norm clip_by_global_norm uses (CSE'd by XLA)
        updates, new_opt = tx.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        lr = schedule(step - state["skipped"])
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "lr": lr}
        if hooks.in_step is not None:
            ctx = StepContext(params=params, grads=grads, new_params=new_params, loss=loss,
                              grad_norm=grad_norm, lr=lr, step=step, aux=aux)
            metrics["extra"] = dict(hooks.in_step(ctx))
        nf = (~finite).astype(jnp.int32)
        new_state = {
            "params": jax.tree.map(keep, new_params, params),
            "opt": jax.tree.map(keep, new_opt, state["opt"]),
            "step": step + 1,
            "skipped": state["skipped"] + nf,
            "consecutive": jnp.where(finite, 0, state["consecutive"] + 1),
        }
        metrics["skipped"] = new_state["skipped"]
        metrics["consecutive"] = new_state["consecutive"]
        return new_state, metrics

    return step_fn


def make_eval_step(*, graphdef: nnx.GraphDef, policy: PrecisionPolicy | None,
                   hooks: Hooks | None = None) -> Callable[..., jax.Array]:
    """``eval_step(params, batch int32[b, T+1], policy_base) -> f32`` summed token CE."""
    forward = _make_forward(graphdef, policy, hooks or Hooks())

    def eval_fn(params, batch, policy_base):
        key = jax.random.fold_in(policy_base, EVAL_STEP)
        ce, _ = forward(params, batch, key, jnp.int32(EVAL_STEP))
        return jnp.sum(ce)

    return eval_fn
