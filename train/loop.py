"""The pretraining loop: `run(config) -> RunSummary`.

One jitted train step (state donated) does, for a global batch int32[B, T+1]:
forward/backward over ``B / micro_batch`` micro-batches (``lax.scan``, grads
summed in fp32), ``optax.chain(clip_by_global_norm, adamw)`` with warmup +
cosine to ``final_lr_ratio * lr`` and weight decay masked off norms, and a
non-finite guard: if the loss or the gradient norm is not finite, parameters
and optimizer state are left unchanged (the batch is consumed, the skip is
counted). After ``train.max_nonfinite`` such steps in a row the run stops with
status ``'nonfinite'`` and a message; the checkpoints written before are
untouched.

Parameters are fp32 master weights (``param_dtype``), the model computes in
``model.compute_dtype``; logits and the loss are fp32. Randomized policies get
``policy_key = fold_in(fold_in(key(seed), 'policy'), step)`` (and the micro-batch
index folded in), so noise differs per step and is the same on resume. Eval
uses a fixed key.

Everything runs under a (data, fsdp, tensor) mesh with the model's partition
rules (`models.sharding`); batches are split over data x fsdp. With
``mesh.distributed`` the loop calls ``jax.distributed.initialize()`` first and
each process reads its slice of every global batch.

Hooks (`Hooks`) let other code add metrics without touching this file:
``forward`` replaces the model call (returning logits and an aux pytree),
``in_step`` computes extra scalars/arrays inside the jitted step from a
`StepContext`, ``on_record`` adds host-side fields to each metrics record. With
no hooks the compiled step is the plain one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from train import data as datamod
from train.checkpoint import Checkpointer, IncompatibleCheckpointError
from train.config import Config, ConfigError
from train.metrics import MetricsWriter, MLLog, Progress, plot_losses, read_jsonl

_POLICY_TAG = 0x706F6C  # folded into the seed key for policy noise
_EVAL_STEP = 2**31 - 1  # step index folded in for the (fixed) eval key


# --------------------------------------------------------------------------- public types

@dataclasses.dataclass(frozen=True, kw_only=True)
class StepContext:
    """What an ``in_step`` hook sees (all traced values inside the jitted step).

    params/grads/new_params: pytrees like the model's pure param dict (fp32).
    ``grads`` are the averaged, unclipped gradients; ``new_params`` the
    parameters after the update (before the non-finite guard). loss, grad_norm,
    lr: f32 scalars; step: int32 scalar (the step being taken, 0-based); aux:
    the forward hook's auxiliary output averaged over micro-batches ({} without).
    """

    params: Any
    grads: Any
    new_params: Any
    loss: jax.Array
    grad_norm: jax.Array
    lr: jax.Array
    step: jax.Array
    aux: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hooks:
    """Optional extension points of the loop (see module docstring)."""

    forward: Callable[..., tuple[jax.Array, Any]] | None = None
    """``forward(model, tokens int32[b, T], *, policy, policy_key, step) -> (logits
    f32[b, T, V], aux)``; ``step`` is the traced int32 step (2**31-1 in evaluation)."""
    in_step: Callable[[StepContext], Mapping[str, Any]] | None = None
    """Returns a dict of arrays computed in the step; they land in the metrics record."""
    on_record: Callable[[dict[str, Any]], Mapping[str, Any] | None] | None = None
    """Host side, called with each record before it is written; may return fields to add."""
    diagnostics: Any = None
    """An ``mxjax.diagnostics.DiagnosticsConfig``: collect the stats of every quantized GEMM
    of the step (``mxjax.diagnostics.value_and_grad_with_stats``); they reach ``in_step``
    as ``ctx.aux['gemm_stats']`` f32[n_slots, 3, fields] (averaged over micro-batches).
    Losses and gradients are unchanged; None (default) compiles the plain step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Result of `run`.

    status: 'completed' (all steps), 'target_reached' (eval <= target),
    'nonfinite' (stopped by the guard). eval_history: [(step, tokens, eval_loss)].
    target_tokens: tokens consumed at the first eval <= target (None if never).
    """

    status: str
    message: str
    steps: int
    tokens: int
    final_eval_loss: float | None
    best_eval_loss: float | None
    eval_history: list[tuple[int, int, float]]
    target_eval_loss: float | None
    target_step: int | None
    target_tokens: int | None
    skipped_steps: int
    wall_time_s: float
    tokens_per_s: float | None
    policy: str
    out_dir: str
    metrics_path: str
    plot_path: str | None
    checkpoint_dir: str | None
    resumed_from: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated run: everything resolved that does not need compilation."""

    config: Config
    model_config: Any  # models.llama.LlamaConfig
    policy: Any  # mxjax PrecisionPolicy | None
    policy_name: str
    policy_record: Any
    mesh_axes: tuple[int, int, int]
    prepared: datamod.PreparedData
    eval_batch: int


# --------------------------------------------------------------------------- resolution

def resolve_policy(spec: str | Mapping[str, Any] | None) -> tuple[Any, str, Any]:
    """(policy or None, display name, JSON record) for a config's ``policy`` entry."""
    if spec is None or (isinstance(spec, str) and spec.lower() == "none"):
        return None, "none", None
    try:
        from mxjax import policies
    except ImportError as e:
        raise ConfigError(f"policy: mxjax.policies is not available ({e})") from None
    if isinstance(spec, str):
        names = tuple(policies.names())
        if spec not in names:
            raise ConfigError(f"policy: unknown policy {spec!r}; known: none, {', '.join(names)}")
        pol = policies.get(spec)
        name = spec
    else:
        try:
            pol = policies.from_dict(dict(spec))
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"policy: invalid policy dict ({type(e).__name__}: {e})") from None
        name = getattr(pol, "name", None) or str(spec.get("name") or "custom")
    return pol, name, _jsonable(policies.to_dict(pol))


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "value") and isinstance(x.value, (str, int)):  # enums
        return x.value
    return str(x)


def build_model_config(config: Config, vocab_size: int, max_token_id: int | None = None):
    """LlamaConfig from ``model.preset`` + overrides, fp32 params, configured compute dtype.

    ``vocab_size`` (the tokenizer's) is the model's vocabulary for the ``tiny``
    preset unless overridden; the Llama presets keep theirs (128256). The data's
    largest token id, when given, must fit the model's vocabulary.
    """
    from models.llama import LlamaConfig, RopeScaling

    ms = config.model
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    over = dict(ms.overrides)
    bad = sorted(set(over) - fields)
    if bad:
        raise ConfigError(f"model.overrides: unknown LlamaConfig field(s) {', '.join(bad)}; "
                          f"valid: {', '.join(sorted(fields))}")
    for k in ("dtype", "param_dtype"):
        if k in over:
            raise ConfigError(f"model.overrides.{k}: not settable here (master weights are fp32;"
                              " use model.compute_dtype for the compute dtype)")
    if isinstance(over.get("rope_scaling"), Mapping):
        try:
            over["rope_scaling"] = RopeScaling(**over["rope_scaling"])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.overrides.rope_scaling: {e}") from None
    if ms.preset == "tiny":  # the small model takes the tokenizer's size; Llama presets keep theirs
        over.setdefault("vocab_size", vocab_size)
    try:
        mc = getattr(LlamaConfig, ms.preset)(**over, dtype=ms.compute_dtype,
                                               param_dtype="float32")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    if max_token_id is not None and max_token_id >= mc.vocab_size:
        raise ConfigError(f"model vocab_size={mc.vocab_size} is too small for the data: token id "
                          f"{max_token_id} occurs (tokenizer vocabulary {vocab_size}); set "
                          "model.overrides.vocab_size")
    if config.data.seq_len > mc.max_seq_len:
        raise ConfigError(f"data.seq_len={config.data.seq_len} is longer than the model supports "
                          f"(max_seq_len={mc.max_seq_len}; raise model.overrides.max_seq_len)")
    return mc


def resolve_mesh(config: Config, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes; a -1 axis takes the devices the others leave."""
    m = config.mesh
    sizes = [m.data, m.fsdp, m.tensor]
    if -1 in sizes:
        i = sizes.index(-1)
        sizes[i] = 1
        sizes[i] = max(1, n_devices // math.prod(sizes))
    data, fsdp, tensor = sizes
    total = data * fsdp * tensor
    if total > n_devices:
        raise ConfigError(f"mesh: data*fsdp*tensor = {data}*{fsdp}*{tensor} = {total} "
                          f"devices, only {n_devices} available")
    micro = config.train.micro_batch or config.train.global_batch
    if micro % (data * fsdp):
        raise ConfigError(f"train.micro_batch (or global_batch) = {micro} must be divisible by "
                          f"mesh data*fsdp = {data * fsdp}")
    return data, fsdp, tensor


def _nominal_vocab(config: Config) -> int:
    d = config.data
    if d.tokenizer == "bpe" or config.model.preset != "tiny":
        return d.vocab_size
    from train.tokenizer import load_hf

    return load_hf(d.tokenizer, eos_token=d.eos_token).vocab_size


def validate(config: Config, *, verbose: bool = True) -> Plan:
    """Check everything that can be checked without compiling; prepare (cached) data.

    Raises ConfigError naming the problem: missing files, unknown policy, model
    overrides, sequence longer than the model supports, mesh/batch sizes,
    too few validation sequences.
    """
    from train.tokenizer import TokenizerError

    datamod.check_files(config.data)
    policy, name, record = resolve_policy(config.policy)
    try:
        build_model_config(config, _nominal_vocab(config))
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    mesh_axes = resolve_mesh(config, jax.device_count())
    t = config.train
    micro = t.micro_batch or t.global_batch
    eval_batch = t.eval_batch or min(micro, t.eval_sequences)
    if eval_batch % (mesh_axes[0] * mesh_axes[1]):
        raise ConfigError(f"train.eval_batch={eval_batch} must be divisible by mesh data*fsdp = "
                          f"{mesh_axes[0] * mesh_axes[1]}")
    try:
        prepared = datamod.prepare(config.data, verbose=verbose)
    except datamod.DataError as e:
        raise ConfigError(f"data: {e}") from None
    mc = build_model_config(config, prepared.vocab_size, int(prepared.meta["max_token_id"]))
    val = datamod.Sequences(prepared.tokens("val"), config.data.seq_len)
    if t.eval_sequences > len(val):
        raise ConfigError(f"train.eval_sequences={t.eval_sequences} but the validation split has "
                          f"only {len(val)} sequences of {config.data.seq_len + 1} tokens")
    if t.eval_sequences % eval_batch:
        raise ConfigError(f"train.eval_sequences ({t.eval_sequences}) must be a multiple of the "
                          f"eval batch ({eval_batch})")
    if datamod.Sequences(prepared.tokens("train"), config.data.seq_len).n == 0:
        raise ConfigError("data: the training split is shorter than one sequence")
    return Plan(config=config, model_config=mc, policy=policy, policy_name=name,
                policy_record=record, mesh_axes=mesh_axes, prepared=prepared,
                eval_batch=eval_batch)


# --------------------------------------------------------------------------- optimizer

def lr_schedule(config: Config) -> Callable[[jax.Array], jax.Array]:
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


def make_optimizer(config: Config) -> tuple[optax.GradientTransformation, Callable]:
    o = config.optim
    sched = lr_schedule(config)
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                    mask=decay_mask),
    )
    return tx, sched


# --------------------------------------------------------------------------- the trainer

def fetch(tree: Any) -> Any:
    """Host numpy copies of a pytree of (replicated) arrays, also on multi-host runs."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_shards[0].data)
        return np.asarray(x)
    return jax.tree.map(one, tree)


class _Null:
    """Stands in for the metrics writers on non-primary hosts."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def _compat(plan: Plan) -> dict[str, Any]:
    """The parts of a run a checkpoint must agree with to be resumed."""
    c = plan.config
    return {
        "model": _jsonable(plan.model_config),
        "policy": plan.policy_record,
        "data": {"fingerprint": plan.prepared.meta["fingerprint"]["hash"],
                 "seq_len": c.data.seq_len},
        "seed": c.seed,
        "optim": {**_jsonable(c.optim), "decay_steps": c.decay_steps},
        "global_batch": c.train.global_batch,
    }


def _check_compat(meta: Mapping[str, Any], want: Mapping[str, Any], where: Path,
                  policy_name: str) -> None:
    have = meta.get("compat", {})
    diffs = []
    for k, v in want.items():
        if have.get(k) != v:
            diffs.append(k)
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
    raise IncompatibleCheckpointError(
        f"the checkpoints in {where} were written by a different run setup and cannot be "
        f"resumed:\n" + "\n".join(lines) + "\nUse another output directory (--out) or delete "
        f"{where} to start over.")


class Trainer:
    """Compiled pieces of a run (built from a validated `Plan`); `run()` trains.

    Useful on its own for benchmarks and tests: ``init_state()`` (the sharded
    fresh state), ``train_step(state, batch) -> (state, metrics)`` (jitted, state
    donated), ``batch(step)`` (the global batch of a step, placed on the mesh),
    ``evaluate(params) -> float`` (mean validation cross-entropy).
    """

    def __init__(self, plan: Plan, hooks: Hooks | None = None, verbose: bool = True):
        from models import sharding as shd
        from models.llama import Llama

        self.plan, self.cfg, self.hooks, self.verbose = plan, plan.config, hooks or Hooks(), verbose
        self.shd = shd
        c = self.cfg
        self.out = c.out_path
        self.out.mkdir(parents=True, exist_ok=True)
        d, f, t = plan.mesh_axes
        self.mesh = shd.make_mesh(data=d, fsdp=f, tensor=t)
        self.rep = NamedSharding(self.mesh, PartitionSpec())
        self.batch_sh = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp")))
        mc = plan.model_config
        abstract = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(c.seed)))
        self.graphdef, abs_params, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise RuntimeError("the model has non-parameter state, which this loop does not "
                               "carry; it would be lost between steps")
        specs = shd.param_partition_specs(abstract, self.mesh)
        abs_pure = nnx.to_pure_dict(abs_params)
        self.param_sh = jax.tree_util.tree_map_with_path(
            lambda p, _: NamedSharding(self.mesh, specs[tuple(k.key for k in p)]), abs_pure)
        self.n_params = int(sum(math.prod(x.shape) for x in jax.tree.leaves(abs_pure)))
        self.tx, self.schedule = make_optimizer(c)
        abs_opt = jax.eval_shape(self.tx.init, abs_pure)
        opt_sh = optax.tree_map_params(self.tx, lambda _, sh: sh, abs_opt, self.param_sh,
                                       transform_non_params=lambda _: self.rep)
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        self.state_sh = {"params": self.param_sh, "opt": opt_sh, "step": self.rep,
                         "skipped": self.rep, "consecutive": self.rep}
        abs_state = {"params": abs_pure, "opt": abs_opt, "step": scalar, "skipped": scalar,
                     "consecutive": scalar}
        self.abs_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state,
            self.state_sh)

        def fresh_state(seed_key):  # the seed is an argument: one compile for all seeds
            model = Llama(mc, rngs=nnx.Rngs(seed_key))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            zero = jnp.zeros((), jnp.int32)
            return {"params": params, "opt": self.tx.init(params), "step": zero,
                    "skipped": zero, "consecutive": zero}

        self._init = jax.jit(fresh_state, out_shardings=self.state_sh)
        self._train_step = jax.jit(self._step_fn,
                                   in_shardings=(self.state_sh, self.batch_sh, self.rep),
                                   out_shardings=(self.state_sh, self.rep), donate_argnums=(0,))
        self._eval_step = jax.jit(self._eval_fn,
                                  in_shardings=(self.param_sh, self.batch_sh, self.rep),
                                  out_shardings=self.rep)
        # data
        pi, pc = jax.process_index(), jax.process_count()
        self.primary = pi == 0
        if plan.eval_batch % pc:
            raise ConfigError(f"the eval batch ({plan.eval_batch}) must be divisible by the "
                              f"number of processes ({pc})")
        T = c.data.seq_len
        self.train_seqs = datamod.Sequences(plan.prepared.tokens("train"), T)
        self.loader = datamod.TrainLoader(self.train_seqs, global_batch=c.train.global_batch,
                                          seed=c.seed, process_index=pi, process_count=pc)
        val = datamod.Sequences(plan.prepared.tokens("val"), T)
        ev = datamod.eval_batches(val, c.train.eval_sequences, plan.eval_batch)
        per = plan.eval_batch // pc
        self.eval_data = [b[pi * per:(pi + 1) * per] for b in ev]
        self.tokens_per_step = c.train.global_batch * T
        self.policy_base = jax.random.fold_in(jax.random.key(c.seed), _POLICY_TAG)

    def init_state(self):
        with self.shd.use_mesh(self.mesh):
            return self._init(jax.random.key(self.cfg.seed))

    def train_step(self, state, batch):
        with self.shd.use_mesh(self.mesh):
            return self._train_step(state, batch, self.policy_base)

    def batch(self, step: int) -> jax.Array:
        return self._put(self.loader.batch(step))

    # -- traced functions ------------------------------------------------------------------

    def _forward(self, params, tokens, key, step):
        model = nnx.merge(self.graphdef, params)
        pol = self.plan.policy
        pkey = key if (pol is not None and getattr(pol, "needs_key", False)) else None
        if self.hooks.forward is not None:
            logits, aux = self.hooks.forward(model, tokens[:, :-1], policy=pol, policy_key=pkey,
                                             step=step)
        else:
            logits, aux = model(tokens[:, :-1], policy=pol, policy_key=pkey), {}
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:])
        return ce, aux

    def _loss(self, params, tokens, key, step):
        ce, aux = self._forward(params, tokens, key, step)
        return jnp.mean(ce), aux

    def _step_fn(self, state, batch, policy_base):
        c = self.cfg
        params, step = state["params"], state["step"]
        key = jax.random.fold_in(policy_base, step)
        if self.hooks.diagnostics is not None:
            from mxjax import diagnostics

            grad_fn = diagnostics.value_and_grad_with_stats(self._loss, self.hooks.diagnostics)
        else:
            grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        accum = c.accum_steps
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
        updates, new_opt = self.tx.update(grads, state["opt"], params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        lr = self.schedule(step - state["skipped"])
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "lr": lr}
        if self.hooks.in_step is not None:
            ctx = StepContext(params=params, grads=grads, new_params=new_params, loss=loss,
                              grad_norm=grad_norm, lr=lr, step=step, aux=aux)
            metrics["extra"] = dict(self.hooks.in_step(ctx))
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

    def _eval_fn(self, params, batch, policy_base):
        key = jax.random.fold_in(policy_base, _EVAL_STEP)
        ce, _ = self._forward(params, batch, key, jnp.int32(_EVAL_STEP))
        return jnp.sum(ce)

    # -- host side ---------------------------------------------------------------------------

    def _log(self, msg: str) -> None:
        if self.verbose and jax.process_index() == 0:
            print(f"[train] {msg}", file=sys.stderr, flush=True)

    def _put(self, local: np.ndarray) -> jax.Array:
        gshape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
        return jax.make_array_from_process_local_data(self.batch_sh, local, gshape)

    def evaluate(self, params) -> float:
        total = 0.0
        for b in self.eval_data:
            total += float(fetch(self._eval_step(params, self._put(b), self.policy_base)))
        return total / (self.cfg.train.eval_sequences * self.cfg.data.seq_len)

    def _meta(self, step: int, status: str, skipped: int, time_s: float) -> dict[str, Any]:
        c = self.cfg
        return {"status": status, "samples": step * c.train.global_batch,
                "tokens": step * self.tokens_per_step, "epoch": self.loader.epoch(step),
                "skipped": skipped, "time_s": time_s, "policy_name": self.plan.policy_name,
                "config": c.to_dict(), "compat": _compat(self.plan)}

    def run(self) -> RunSummary:
        c, t = self.cfg, self.cfg.train
        t_start = time.time()
        ckpt = None
        start, time_off, resumed, skipped = 0, 0.0, None, 0
        if c.checkpoint.enabled:
            ckpt = Checkpointer(self.out / "checkpoints", keep=c.checkpoint.keep,
                                async_save=c.checkpoint.async_save)
        elif (self.out / "checkpoints").is_dir() and any((self.out / "checkpoints").iterdir()):
            raise ConfigError(f"checkpoint.enabled is false but {self.out}/checkpoints holds "
                              "checkpoints of an earlier run; use another output directory "
                              "(--out) rather than overwrite it")
        state, meta = None, None
        if ckpt is not None and ckpt.latest_step() is not None:
            latest = ckpt.latest_step()
            try:
                meta = ckpt.read_meta(latest)
                _check_compat(meta, _compat(self.plan), ckpt.directory, self.plan.policy_name)
                state = ckpt.restore(latest, self.abs_state, meta)
            except BaseException:
                ckpt.close()
                raise
            start, resumed = latest, latest
            time_off = float(meta.get("time_s", 0.0))
            skipped = int(meta.get("skipped", 0))
            self._log(f"resuming from checkpoint step {latest} in {ckpt.directory}")
        if self.primary:
            (self.out / "config.yaml").write_text(yaml.safe_dump(c.to_dict(), sort_keys=False))
            writer = MetricsWriter(self.out / "metrics.jsonl", resume_step=resumed)
            mll = MLLog(self.out / "mllog.txt", resume_step=resumed)
        else:  # other hosts of a multi-host run write nothing
            writer, mll = _Null(), _Null()
        done_status = meta.get("status") if meta else None
        already = resumed is not None and (
            resumed >= t.steps or (done_status == "target_reached"
                                   and meta["config"]["train"]["target_eval_loss"]
                                   == t.target_eval_loss))
        if already:
            writer.close()
            mll.close()
            if ckpt is not None:
                ckpt.close()
            prev = _read_summary(self.out / "summary.json")
            if prev is not None and prev.steps == resumed:
                note = "run already complete; nothing to do"
                msg = prev.message if prev.message.startswith(note) else f"{note} ({prev.message})"
                return dataclasses.replace(prev, message=msg, resumed_from=resumed)
            return self._summary(done_status if done_status in ("completed", "target_reached")
                                 else "completed", "run already complete; nothing to do",
                                 resumed, skipped, time_off, None, resumed)
        self._log(f"run dir {self.out} | model {self.n_params / 1e6:.2f}M params | policy "
                  f"{self.plan.policy_name} | mesh data={self.plan.mesh_axes[0]} "
                  f"fsdp={self.plan.mesh_axes[1]} tensor={self.plan.mesh_axes[2]} | "
                  f"{len(self.train_seqs)} train sequences of {c.data.seq_len} tokens")
        if resumed is None:
            mll.event("submission_benchmark", "llama31_8b" if c.model.preset == "llama3_8b"
                      else c.name, step=0)
            for k, v in (("global_batch_size", t.global_batch),
                         ("max_sequence_length", c.data.seq_len),
                         ("gradient_accumulation_steps", c.accum_steps),
                         ("opt_base_learning_rate", c.optim.lr),
                         ("opt_learning_rate_warmup_steps", c.optim.warmup_steps),
                         ("opt_learning_rate_decay_steps", c.decay_steps),
                         ("opt_end_learning_rate", c.optim.lr * c.optim.final_lr_ratio),
                         ("opt_adamw_beta_1", c.optim.b1), ("opt_adamw_beta_2", c.optim.b2),
                         ("opt_adamw_epsilon", c.optim.eps),
                         ("opt_adamw_weight_decay", c.optim.weight_decay),
                         ("opt_gradient_clip_norm", c.optim.clip_norm), ("seed", c.seed),
                         ("eval_samples", t.eval_sequences), ("target_accuracy", t.target_eval_loss),
                         ("precision_policy", self.plan.policy_name)):
                mll.event(k, v, step=0)
            mll.event("run_start", step=0, event_type="INTERVAL_START")
        with self.shd.use_mesh(self.mesh):
            if state is None:
                state = self._init(jax.random.key(c.seed))
            return self._loop(state, start, resumed, skipped, time_off, t_start, ckpt, writer,
                              mll)

    def _record(self, step: int, **kw: Any) -> dict[str, Any]:
        rec = {"step": step, "tokens": step * self.tokens_per_step, "loss": None,
               "eval_loss": None, "lr": None, "grad_norm": None, "tokens_per_s": None,
               "skipped_steps": 0, "policy": self.plan.policy_name,
               "epoch": round(self.loader.epoch(step), 4)}
        rec.update(kw)
        return rec

    def _emit(self, writer: MetricsWriter, rec: dict[str, Any]) -> None:
        if self.hooks.on_record is not None:
            more = self.hooks.on_record(dict(rec))
            if more:
                rec.update(more)
        writer.write(rec)

    def _loop(self, state, start, resumed, skipped, time_off, t_start, ckpt, writer, mll):
        c, t = self.cfg, self.cfg.train
        prog = Progress(t.steps, mode=t.progress if jax.process_index() == 0 else "off",
                        start=start)
        status, message = "completed", ""
        t_run = time.time()
        last_ckpt = ckpt.latest_step() if ckpt is not None else None
        step = start
        steady_t, steady_n = 0.0, 0

        def now() -> float:
            return time_off + time.time() - t_run

        def do_eval(at: int) -> float:
            loss = self.evaluate(state["params"])
            mll.event("eval_start", step=at, samples_count=at * t.global_batch)
            mll.eval_accuracy(loss, step=at, samples_count=at * t.global_batch)
            mll.event("eval_stop", step=at, samples_count=at * t.global_batch)
            return loss

        if start == 0 and t.eval_at_start:
            ev = do_eval(0)
            self._emit(writer, self._record(0, eval_loss=ev, time_s=round(now(), 3),
                                            lr=float(self.schedule(0))))
            prog.update(0, loss=None, tokens_per_s=None, eval_loss=ev)
        try:
            while step < t.steps:
                t0 = time.time()
                batch = self._put(self.loader.batch(step))
                state, m = self._train_step(state, batch, self.policy_base)
                m = fetch(m)
                step += 1
                dt = time.time() - t0
                if step > start + 1:
                    steady_t, steady_n = steady_t + dt, steady_n + 1
                tps = self.tokens_per_step / dt
                skipped = int(m["skipped"])
                loss = float(m["loss"])
                ev = None
                stop = False
                if int(m["consecutive"]) >= t.max_nonfinite:
                    status = "nonfinite"
                    where = (f"step {last_ckpt} in {ckpt.directory}" if last_ckpt is not None
                             else "none written")
                    message = (f"stopped at step {step}: {t.max_nonfinite} consecutive steps "
                               f"(steps {step - t.max_nonfinite + 1}-{step}) had a non-finite loss"
                               f" or gradient norm; their updates were skipped ({skipped} skipped "
                               f"in total). Last good checkpoint: {where}.")
                    stop = True
                elif (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                    ev = do_eval(step)
                    if t.target_eval_loss is not None and ev <= t.target_eval_loss:
                        status = "target_reached"
                        message = (f"eval loss {ev:.4f} <= target {t.target_eval_loss} at step "
                                   f"{step} ({step * self.tokens_per_step} tokens)")
                        stop = True
                if step % t.log_every == 0 or ev is not None or stop or step == t.steps:
                    rec = self._record(step, loss=loss, eval_loss=ev, lr=float(m["lr"]),
                                       grad_norm=float(m["grad_norm"]),
                                       tokens_per_s=round(tps, 1), skipped_steps=skipped,
                                       time_s=round(now(), 3))
                    if not bool(m["finite"]):
                        rec["nonfinite"] = True
                    if "extra" in m:
                        rec.update({k: np.asarray(v).tolist() for k, v in m["extra"].items()})
                    self._emit(writer, rec)
                prog.update(step, loss=loss, tokens_per_s=tps, eval_loss=ev)
                if status == "nonfinite":
                    break
                final = stop or step == t.steps
                if ckpt is not None and (final or (c.checkpoint.every
                                                   and step % c.checkpoint.every == 0)):
                    st = status if final else "running"
                    ckpt.save(step, state, self._meta(step, st, skipped, now()))
                    last_ckpt = step
                if stop:
                    break
        finally:
            prog.close()
            writer.close()
            if ckpt is not None:
                ckpt.close()
        if status == "completed":
            message = f"trained {step} steps ({step * self.tokens_per_step} tokens)"
        mll.event("run_stop", step=step, event_type="INTERVAL_END",
                  status="success" if status == "target_reached" else
                  ("aborted" if status == "nonfinite" or t.target_eval_loss is not None
                   else "completed"), samples_count=step * t.global_batch)
        mll.close()
        tps = self.tokens_per_step * steady_n / steady_t if steady_n else None
        return self._summary(status, message, step, skipped, time.time() - t_start, tps, resumed)

    def _summary(self, status, message, step, skipped, wall, tps, resumed) -> RunSummary:
        c, t = self.cfg, self.cfg.train
        recs = read_jsonl(self.out / "metrics.jsonl")
        evals = [(int(r["step"]), int(r["tokens"]), float(r["eval_loss"])) for r in recs
                 if isinstance(r.get("eval_loss"), (int, float))]
        target_step = target_tokens = None
        if t.target_eval_loss is not None:
            for s, tok, e in evals:
                if e <= t.target_eval_loss:
                    target_step, target_tokens = s, tok
                    break
        plot_path = None
        if t.plot and self.primary and recs:
            title = f"{c.name} | policy {self.plan.policy_name}"
            if evals:
                title += f" | final eval {evals[-1][2]:.4f}"
            plot_path = str(plot_losses(recs, self.out / "plot.png", title=title))
        s = RunSummary(
            status=status, message=message, steps=step, tokens=step * self.tokens_per_step,
            final_eval_loss=evals[-1][2] if evals else None,
            best_eval_loss=min(e for _, _, e in evals) if evals else None,
            eval_history=evals, target_eval_loss=t.target_eval_loss, target_step=target_step,
            target_tokens=target_tokens, skipped_steps=skipped, wall_time_s=round(wall, 3),
            tokens_per_s=round(tps, 1) if tps else None, policy=self.plan.policy_name,
            out_dir=str(self.out), metrics_path=str(self.out / "metrics.jsonl"),
            plot_path=plot_path,
            checkpoint_dir=str(self.out / "checkpoints") if c.checkpoint.enabled else None,
            resumed_from=resumed)
        if self.primary:
            (self.out / "summary.json").write_text(json.dumps(s.to_dict(), indent=1))
        return s


def _read_summary(path: Path) -> RunSummary | None:
    try:
        d = json.loads(path.read_text())
        d["eval_history"] = [tuple(e) for e in d["eval_history"]]
        return RunSummary(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def init_distributed(mesh: Any = None) -> None:
    """``jax.distributed.initialize()`` once per process.

    `mesh` (a config's MeshSection) may give coordinator_address, num_processes
    and process_id; unset ones are left to JAX's cluster auto-detection.
    """
    if jax.distributed.is_initialized():
        return
    kw = {}
    for k in ("coordinator_address", "num_processes", "process_id"):
        v = getattr(mesh, k, None) if mesh is not None else None
        if v is not None:
            kw[k] = v
    jax.distributed.initialize(**kw)


def use_compile_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at `path` (once per process)."""
    if not path:
        return
    current = jax.config.jax_compilation_cache_dir
    if current is None:
        Path(path).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    elif str(Path(current)) != str(Path(path)):
        print(f"[train] note: JAX compilation cache already set to {current}; "
              f"jax_cache_dir={path} not applied", file=sys.stderr)


def run(config: Config, *, hooks: Hooks | None = None, verbose: bool = True) -> RunSummary:
    """Train per `config`; resume from its output directory's checkpoints if any.

    Returns a `RunSummary` (also written to ``<out>/summary.json``). Raises
    ConfigError for configuration problems (before compiling) and
    train.checkpoint.CheckpointError for unreadable/incompatible checkpoints.
    """
    if config.mesh.distributed:
        init_distributed(config.mesh)
    use_compile_cache(config.jax_cache_dir)
    plan = validate(config, verbose=verbose)
    return Trainer(plan, hooks, verbose).run()
