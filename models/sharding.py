"""Logical-axis sharding for the Llama model on a (data, fsdp, tensor) mesh.

Every parameter of :class:`models.llama.Llama` carries ``logical_axes``
metadata (e.g. ``('layers', 'embed', 'mlp')``); activations are annotated with
:func:`constrain`. Rules map logical axes to mesh axes; the first listed mesh
axis that exists in the mesh and is not yet used by an earlier dimension of
the same array wins (Linen/MaxText semantics), so e.g. ``batch`` takes both
``data`` and ``fsdp`` while ``embed`` takes ``fsdp`` only on parameters.

Typical use::

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shard_model(model, mesh)                    # place params per the rules, or
    model = sharded_init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh)  # init in shards
    with use_mesh(mesh):                        # activation constraints on
        logits = jax.jit(fn)(model_state, tokens)

Activation constraints are resolved when a function is traced: trace (jit)
inside ``use_mesh``. Outside it, :func:`constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "Rules",
    "active_mesh",
    "constrain",
    "logical_to_pspec",
    "make_mesh",
    "param_logical_axes",
    "param_partition_specs",
    "param_shardings",
    "shard_model",
    "sharded_init",
    "use_mesh",
]

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
)

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "models_sharding_active", default=None)


def make_mesh(*, data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (data, fsdp, tensor) over ``data * fsdp * tensor`` devices."""
    n = data * fsdp * tensor
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < n:
        raise ValueError(f"make_mesh(data={data}, fsdp={fsdp}, tensor={tensor}) needs {n} "
                         f"devices, only {len(devs)} available")
    arr = np.asarray(devs[:n], dtype=object).reshape(data, fsdp, tensor)
    return Mesh(arr, MESH_AXES)


def logical_to_pspec(axes: Sequence[str | None], rules: Rules = DEFAULT_RULES,
                     mesh: Mesh | None = None,
                     shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have logical names ``axes``.

    Mesh axes absent from ``mesh`` (when given) are skipped, each mesh axis is
    used at most once per array. With ``shape`` and ``mesh``, a dimension that
    the chosen mesh axes do not divide raises ValueError.
    """
    table: dict[str, str | tuple[str, ...] | None] = {}
    for name, target in rules:
        table.setdefault(name, target)
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"no sharding rule for logical axis {name!r} (rules cover "
                             f"{sorted(table)})")
        target = table[name]
        cand = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        if mesh is not None:
            cand = tuple(a for a in cand if a in mesh.axis_names)
        cand = tuple(a for a in cand if a not in used)
        used.update(cand)
        if shape is not None and mesh is not None and cand:
            size = math.prod(mesh.shape[a] for a in cand)
            if shape[dim] % size:
                raise ValueError(
                    f"logical axis {name!r} (dimension {dim} of size {shape[dim]}) is not "
                    f"divisible by mesh axes {cand} of total size {size}")
        out.append(None if not cand else (cand[0] if len(cand) == 1 else cand))
    return PartitionSpec(*out)


def _flat_params(model: nnx.Module):
    return nnx.to_flat_state(nnx.state(model, nnx.Param))


def param_logical_axes(model: nnx.Module) -> dict[tuple, tuple[str, ...]]:
    """{param path: logical axes} for every parameter (raises if one lacks them)."""
    out = {}
    for path, var in _flat_params(model):
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter {'.'.join(map(str, path))} has no logical_axes")
        if len(axes) != len(var.shape):
            raise ValueError(f"parameter {'.'.join(map(str, path))}: logical_axes {axes} do "
                             f"not match its shape {var.shape}")
        out[path] = tuple(axes)
    return out


def param_partition_specs(model: nnx.Module, mesh: Mesh,
                          rules: Rules = DEFAULT_RULES) -> dict[tuple, PartitionSpec]:
    """{param path: PartitionSpec} per the rules (works on abstract models too)."""
    shapes = {p: v.shape for p, v in _flat_params(model)}
    return {p: logical_to_pspec(a, rules, mesh, shapes[p])
            for p, a in param_logical_axes(model).items()}


def param_shardings(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """An ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)`` holding NamedShardings
    (e.g. for ``jax.jit(out_shardings=...)``)."""
    specs = param_partition_specs(model, mesh, rules)
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    leaves = []
    for path, var in flat:
        leaves.append((path, var.replace(NamedSharding(mesh, specs[path]))))
    return nnx.from_flat_state(leaves)


def sharded_init(make_model: Callable[[], nnx.Module], mesh: Mesh,
                 rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Build ``make_model()`` with every parameter created directly in its shards.

    The model is traced abstractly first (no allocation), then initialised under
    ``jax.jit`` with ``out_shardings`` from the rules, so no device ever holds a
    whole replica (use this for the 8B model). ``make_model`` must be pure (e.g.
    ``lambda: Llama(cfg, rngs=nnx.Rngs(0))``); the values equal an unsharded init.
    """
    model = nnx.eval_shape(make_model)
    shardings = param_shardings(model, mesh, rules)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        return nnx.state(make_model(), nnx.Param)

    nnx.update(model, init())
    return model


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Move every parameter of ``model`` onto ``mesh`` as the rules say (in place)."""
    specs = param_partition_specs(model, mesh, rules)
    for path, var in _flat_params(model):
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, specs[path])))


def active_mesh() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the innermost :func:`use_mesh`, or None outside one."""
    return _ACTIVE.get()


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[Mesh]:
    """Turn on activation sharding constraints (for functions traced inside)."""
    token = _ACTIVE.set((mesh, tuple(rules)))
    try:
        yield mesh
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical axes inside :func:`use_mesh`; else identity."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_pspec(axes, rules, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
