"""Module paths in ``mxjax.nn.wrap``: the one format, and where each front end reads it.

Format. A module path is the names from the root module down to the module a
matmul belongs to, joined by ``'/'``: ``'up'``, ``'layers_0/attn/q_einsum'``,
``'blocks/0/attn/query'``; ``''`` is the root module's own code (``(root)`` in
``str(report)``). No method names, no markers. ``Rule(path=regex)`` is matched
against it with ``re.fullmatch``; ``Site.path`` is it.

Sources. Every path is read from the traced program itself (its name stacks and
its data flow), never from Python state a trace cache could skip, so a trace that
``jax.jit``/``nn.jit``/``nnx.jit``/remat/scan reuse gives the same paths, and
mxjax puts nothing into the user's code that a plain call could see later.

* Linen: the name stack. Flax runs each module method under
  ``jax.named_scope('<module name>[.<method>]')``; the path is those scopes
  below the root module's own, without the ``.<method>`` suffixes (and without
  the scope a module opens again when it calls its own method) and without
  JAX's entries (transforms such as ``jvp``/``vmap``, ``jnp.einsum``'s
  subscripts scope). Your own ``jax.named_scope`` names stay in it (the path is
  the call path, as profiles show it). A matmul whose weight is a parameter of a
  module *below* that path (a parent using its child's parameter, e.g. a tied
  head ``jnp.dot(x, embed.embedding.T)``) is at the parameter's module.
* NNX: NNX records no module scopes, so the path comes from the data. A matmul
  with a weight (an operand computed from parameters alone) is at the module
  owning that parameter (the Variable's graph path without its name, e.g.
  ``'blocks/0/attn/query'``; the stacked parameters of ``nnx.vmap``/``nnx.scan``
  layers: ``'layers/q_proj'``); a matmul of two activations at the deepest
  module containing the modules whose outputs both operands come from (e.g.
  attention scores ``q·k`` at ``'blocks/0/attn'``). Only floating-point state
  counts (RNG keys and counters own nothing).
* Functions: the ``jax.named_scope`` names around the matmul.

HLO. The ops mxjax emits for a matmul run under the matmul's own name stack,
extended by the trailing path components it does not carry (NNX: the whole
path; Linen: a parameter's module below the call path), so the ``op_name`` of
every such op, with JAX's entries dropped, ends with the site's path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jax.extend import source_info_util as siu

__all__ = ["FRONT_ENDS", "PathSource", "as_str", "common_prefix", "is_jax_scope", "key_name",
           "scope_names"]

Path = tuple[str, ...]
FRONT_ENDS = ("function", "linen", "nnx")
_TRANSFORM = type(siu.NameStack().transform("t").stack[0])  # jvp(...), vmap(...), ...


def as_str(path: Path) -> str:
    return "/".join(path)


def common_prefix(paths: Iterable[Path | None]) -> Path | None:
    """The deepest path containing every given path (None entries ignored; all None: None)."""
    out: Path | None = None
    for p in paths:
        if p is None:
            continue
        if out is None:
            out = p
            continue
        n = 0
        while n < min(len(out), len(p)) and out[n] == p[n]:
            n += 1
        out = out[:n]
    return out


def is_jax_scope(name: str) -> bool:
    """Whether a name-stack scope is JAX's own: ``jnp.einsum`` names one by its subscripts."""
    return "," in name or "->" in name


def scope_names(name_stack) -> Path:
    """The scope names of a ``NameStack``, without JAX's transforms and einsum scopes."""
    return tuple(s.name for s in name_stack.stack
                 if not isinstance(s, _TRANSFORM) and not is_jax_scope(s.name))


def key_name(k) -> str:
    """The name of one pytree path entry (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PathSource:
    """How one front end of ``wrap`` reads module paths (see the module docstring).

    Attributes:
      front_end: ``'function'``, ``'linen'`` or ``'nnx'``.
      roots: Linen: the names the root module's own scope may have (its ``name``,
        or its class's name; a class lifted by ``nn.jit``/``nn.remat``/... names
        the scope after the class it wraps), when the applied method is one of
        its methods (Flax opens that scope); else ``()``.
    """

    front_end: str
    roots: tuple[str, ...] = ()

    def __post_init__(self):
        if self.front_end not in FRONT_ENDS:
            raise ValueError(f"front_end: expected one of {FRONT_ENDS}, got {self.front_end!r}")

    def call_path(self, name_stack) -> Path:
        """The call path a name stack records (NNX: none, ``()``).

        Raises:
          ValueError: Linen, when the root module's scope is missing (Flax's
            module scopes are off: ``nn.disable_named_call()``).
        """
        if self.front_end == "nnx":
            return ()
        names = scope_names(name_stack)
        if self.front_end == "function":
            return names
        if self.roots and (not names or names[0].split(".", 1)[0] not in self.roots):
            raise ValueError(
                f"mxjax.nn.wrap: a matmul of the Linen module {self.roots[0]!r} ran outside its "
                f"module scope (name stack {str(name_stack)!r}): Flax's module scopes are off "
                "(nn.disable_named_call() or flax_profile=False), and module paths come from "
                "them; call nn.enable_named_call() before wrapping")
        out: list[str] = []
        owner = names[0].split(".", 1)[0] if self.roots else None  # the module now running
        for raw in names[1:] if self.roots else names:
            name, dot, _ = raw.partition(".")  # 'embed.attend' -> 'embed'
            if dot and name == (out[-1] if out else owner):
                continue  # a module calling its own method: Flax opens its scope again
            out.append(name)
        return tuple(out)

    def site_path(self, call: Path, weight: Path | None, origin: Path | None) -> tuple[Path, Path]:
        """(site path, the trailing components the call path lacks) of one matmul.

        `weight`: the module owning the matmul's weight operand (None: no weight,
        or one owned by no module); `origin`: the module the data flow assigns it.
        """
        if self.front_end == "nnx":
            path = origin if origin is not None else ()
            return path, path
        if (self.front_end == "linen" and weight is not None and len(weight) > len(call)
                and weight[:len(call)] == call):
            return weight, weight[len(call):]
        return call, ()

    def owner(self, keypath: Sequence) -> Path | None:
        """The module owning a parameter leaf at `keypath` (within the parameter argument).

        Linen: ``variables['params']['up']['kernel']`` -> ``('up',)`` (the
        collection and the variable's name dropped); NNX: the graph path of the
        Variable without its name; functions: None (parameters own no module).
        """
        if self.front_end == "function":
            return None
        names = [key_name(k) for k in keypath if not hasattr(k, "name")]  # no .value attrs
        if self.front_end == "linen":
            names = names[1:]
        return tuple(names[:-1]) if names else None
