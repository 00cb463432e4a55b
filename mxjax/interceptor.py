"""The dot_general interceptor: fprop, dgrad and wgrad each under their own recipe.

``dot_general(lhs, rhs, dimension_numbers, ..., policy=..., key=...)`` is a
drop-in for ``jax.lax.dot_general`` with a ``jax.custom_vjp``:

* fprop computes ``dot_general(lhs, rhs, dims)`` under ``policy.fprop``;
* dgrad computes the lhs cotangent as ``dot_general(g, rhs, dims_l)`` under
  ``policy.dgrad`` and wgrad the rhs cotangent as ``dot_general(g, lhs, dims_r)``
  under ``policy.wgrad``, where ``dims_l``/``dims_r`` and the final transposes
  follow JAX's transpose rule for ``dot_general`` (``_dot_general_transpose_lhs``
  / ``_rhs``), for any dimension numbers.

Each GEMM runs through :func:`mxjax.gemm.gemm` (canonical operands, rotation,
quantization and the per-platform form; see that module).

Keys: ``key`` is split into three (fprop, dgrad, wgrad, in that order); each
GEMM's key is split into three again (lhs rounding, rhs rounding, Hadamard
signs). The forward residuals are the high-precision primals: the backward
re-quantizes them along its own axes. Pass-through GEMMs call
``lax.dot_general`` exactly as JAX's own differentiation rule would.

Higher-order derivatives: a quantized GEMM (in fprop, dgrad or wgrad) that is
differentiated again uses the straight-through rule, the derivative of the
unquantized ``lax.dot_general`` of the same operands, so ``jax.grad`` of
``jax.grad`` and forward-over-reverse Hessian-vector products are defined (not
zero). Forward mode through a quantizing policy (``jax.jvp``/``jax.jacfwd`` of
the function itself) raises a TypeError saying what to use instead. See
docs/NUMERICS.md, "Second-order derivatives".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import ad as _ad
from jax.custom_derivatives import SymbolicZero
from jax.interpreters.ad import JVPTracer

from mxjax.dimensions import Dims, backward_dimension_numbers, normalize_dimension_numbers
from mxjax.gemm import gemm, gemm_packed_rhs, has_explicit_axes
from mxjax.gemm_record import GemmRecord
from mxjax.operands import split_key
from mxjax.quantization import FLOAT_DTYPES
from mxjax.recipes import GemmRecipe, PolicyRecipes, check_policy_recipes
from mxjax.residuals import PackedResidual, pack_rhs, saves_packed

__all__ = ["DotGeneralCall", "GemmRecord", "dot_general", "observe"]


# --------------------------------------------------------------------------- #
# The observer hook
# --------------------------------------------------------------------------- #
# hook(call: DotGeneralCall) -> call(call.lhs, call.rhs, call.key, on_gemm=...).
# Context-local: set only inside `observe`.
_HOOK: contextvars.ContextVar[Callable[..., jax.Array] | None] = contextvars.ContextVar(
    "mxjax_interceptor_hook", default=None)


@contextlib.contextmanager
def observe(hook: Callable[..., jax.Array]):
    """Routes every quantized ``dot_general`` traced inside the block through `hook`.

    The one extension point of the interceptor (``mxjax.diagnostics`` uses it to
    collect GEMM statistics, the study's probe to capture GEMMs). Once per
    quantized call, at trace time, the interceptor calls ``hook(call)`` instead
    of running the call; ``call`` is a :class:`DotGeneralCall` (``call.lhs``,
    ``call.rhs``, ``call.key``, ``call.dims``, ``call.policy``). The hook must
    return ``call(call.lhs, call.rhs, call.key, on_gemm=...)``: it may wrap that
    in its own custom VJP (passing the arrays through, to see the cotangent), and
    ``on_gemm(record)`` receives a :class:`mxjax.gemm_record.GemmRecord` for each
    of the call's three GEMMs as it runs: fprop in the forward pass, then dgrad
    and wgrad, in that order, in the backward pass.
    Pass-through policies never reach the hook. Outside the block nothing is
    added to the traced program.
    """
    if not callable(hook):
        raise TypeError(f"hook: expected a callable, got {hook!r}")
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


# --------------------------------------------------------------------------- #
# custom_vjp
# --------------------------------------------------------------------------- #
class _Static(NamedTuple):
    dims: Dims
    precision: Any
    preferred_element_type: Any
    policy: PolicyRecipes
    out_sharding: Any = None  # of the forward result, as for lax.dot_general
    # Quantized GEMMs inside the custom_vjp get the straight-through rule for higher
    # derivatives. Off while an observer watches (first-order only): a custom_jvp
    # traces its body apart, where the GEMM's records could not get out.
    straight_through: bool = True
    # An observer's on_gemm(GemmRecord), called as each of the three GEMMs runs.
    on_gemm: Callable[[GemmRecord], None] | None = None
    # The dtype both primal operands are cast to first (dot_general's operand_dtype).
    operand_dtype: Any = None


class _GemmSpec(NamedTuple):
    """The static part of one GEMM of the custom_vjp (hashable: a nondiff argument)."""

    dims: Dims
    recipe: GemmRecipe
    precision: Any
    preferred_element_type: Any
    gemm_name: str
    out_sharding: Any = None  # as lax.dot_general's (set under a mesh with explicit axes)
    operand_dtypes: Any = None  # gemm's: the dtypes (or None) a and b are cast to first


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _ste_gemm(a, b, key, spec: _GemmSpec):
    """A quantized GEMM whose own derivative is the straight-through one.

    Its value is ``gemm(a, b)`` under ``spec.recipe``; its derivative is that of
    the unquantized ``lax.dot_general(a, b)`` (the quantization error is held
    constant). First-order gradients never reach this rule (the custom_vjp's
    backward runs the policy's dgrad/wgrad instead); it gives second and higher
    derivatives (``jax.grad`` of ``jax.grad``, ``jax.hessian``, Hessian-vector
    products) a defined meaning where rounding's own derivative is zero.
    """
    return gemm(a, b, spec.dims, spec.recipe, key, precision=spec.precision,
                preferred_element_type=spec.preferred_element_type, gemm_name=spec.gemm_name,
                out_sharding=spec.out_sharding, operand_dtypes=spec.operand_dtypes)


def _cast_to(x, dtype):
    return x if dtype is None or type(x) is SymbolicZero else x.astype(dtype)


@functools.partial(_ste_gemm.defjvp, symbolic_zeros=True)
def _ste_gemm_jvp(spec: _GemmSpec, primals, tangents):
    a, b, key = primals
    ta, tb, _ = tangents
    out = _ste_gemm(a, b, key, spec)
    da, db = spec.operand_dtypes or (None, None)
    a, ta = _cast_to(a, da), _cast_to(ta, da)
    b, tb = _cast_to(b, db), _cast_to(tb, db)
    kw = {"precision": spec.precision, "preferred_element_type": spec.preferred_element_type}
    if spec.out_sharding is not None:
        kw["out_sharding"] = spec.out_sharding
    dims = spec.dims.as_lax()
    parts = []
    if type(ta) is not SymbolicZero:
        parts.append(lax.dot_general(ta, b, dims, **kw))
    if type(tb) is not SymbolicZero:
        parts.append(lax.dot_general(a, tb, dims, **kw))
    if not parts:
        return out, SymbolicZero(jax.typeof(out).to_tangent_aval())
    return out, functools.reduce(operator.add, parts).astype(out.dtype)


def _differentiable_gemm(a, b, key, spec: _GemmSpec, straight_through: bool = True):
    """``gemm`` for use inside the custom_vjp: pass-through GEMMs differentiate as
    ``lax.dot_general`` does, quantized ones with the straight-through rule."""
    if spec.recipe.is_passthrough or not straight_through:
        return gemm(a, b, spec.dims, spec.recipe, key, precision=spec.precision,
                    preferred_element_type=spec.preferred_element_type,
                    gemm_name=spec.gemm_name, out_sharding=spec.out_sharding,
                    operand_dtypes=spec.operand_dtypes)
    return _ste_gemm(a, b, key if spec.recipe.needs_key else None, spec)


def _observed(st: _Static, spec: _GemmSpec, a, b, key, out, perm) -> None:
    """Hands one GEMM's record to the observer's on_gemm (nothing without one)."""
    if st.on_gemm is None:
        return
    st.on_gemm(GemmRecord(name=spec.gemm_name, recipe=spec.recipe, lhs=a, rhs=b, dims=spec.dims,
                          call_dims=st.dims, out_perm=perm, key=key, out=out,
                          precision=spec.precision,
                          preferred_element_type=spec.preferred_element_type))


def _fprop(lhs, rhs, key, st: _Static):
    kf, _, _ = split_key(key)
    # Under a mesh with explicit axes the GEMM itself takes the result's sharding
    # (lax.dot_general's semantics); otherwise the result is resharded afterwards.
    explicit = has_explicit_axes(lhs, rhs)
    d = st.operand_dtype
    spec = _GemmSpec(st.dims, st.policy.fprop, st.precision, st.preferred_element_type,
                     "fprop", st.out_sharding if explicit else None,
                     None if d is None else (d, d))
    out = _differentiable_gemm(lhs, rhs, kf, spec, st.straight_through)
    _observed(st, spec, lhs, rhs, kf, out, tuple(range(out.ndim)))
    if st.out_sharding is not None and not explicit:
        out = jax.sharding.reshard(out, st.out_sharding)
    return out


def _cotangent_sharding(primal: jax.Array, perm: tuple[int, ...]):
    """A backward GEMM's out_sharding, as JAX's transpose rule for dot_general gives it:
    the primal's sharding in the GEMM's output layout (the cotangent is the output
    transposed by `perm`). None unless the primal's mesh has explicit axes."""
    if isinstance(primal, PackedResidual) or not has_explicit_axes(primal):
        return None
    sharding = jax.typeof(primal).sharding
    spec = tuple(sharding.spec) + (None,) * (primal.ndim - len(sharding.spec))
    inverse = np.argsort(np.asarray(perm, dtype=int))
    return sharding.update(spec=sharding.spec.update(
        partitions=tuple(spec[int(i)] for i in inverse)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _policy_dot(lhs, rhs, key, st: _Static):
    return _fprop(lhs, rhs, key, st)


def _packs(st: _Static, lhs, rhs) -> bool:
    """Whether this call may save packed residuals (`mxjax.residuals`): not observed, not
    under a mesh with explicit axes, not differentiated again (a JVP tracer on a primal)."""
    return (st.on_gemm is None and st.straight_through and not has_explicit_axes(lhs, rhs)
            and not any(isinstance(x, _AD_TRACERS) for x in (lhs, rhs)))


# The tracers of a primal being differentiated again (forward-over-reverse: JVP;
# reverse-over-reverse: linearize).
_AD_TRACERS = tuple(t for t in (JVPTracer, getattr(_ad, "LinearizeTracer", None)) if t)


def _primal_dtype(res) -> Any:
    return res.primal_dtype if isinstance(res, PackedResidual) else res.dtype


def _policy_dot_fwd(lhs, rhs, key, st: _Static):
    out = _fprop(lhs, rhs, key, st)
    if not _packs(st, lhs, rhs):
        return out, (lhs, rhs, key)
    # The backward GEMMs' rhs operands (W for dgrad, X for wgrad), quantized now where
    # the GEMM would quantize exactly these values (mxjax.residuals).
    _, kd, kw = split_key(key)
    (d_dims, _), (w_dims, _) = backward_dimension_numbers(st.dims, lhs.ndim, rhs.ndim)
    d = st.operand_dtype
    # Under operand_dtype the residual W is the primal as stored (e.g. the f32 master
    # weight), which stays alive anyway: a packed copy would only add memory.
    if d is None and saves_packed(st.policy.dgrad):
        rhs = pack_rhs(rhs, d_dims, st.policy.dgrad, kd, d)
    if saves_packed(st.policy.wgrad):
        lhs = pack_rhs(lhs, w_dims, st.policy.wgrad, kw, d)
    return out, (lhs, rhs, key)


def _backward_gemm(g, b, key, spec: _GemmSpec, straight_through: bool):
    """One backward GEMM of `g` and the residual `b` (a primal, or a `PackedResidual`)."""
    if isinstance(b, PackedResidual):
        return gemm_packed_rhs(g, b.q, b.primal, spec.dims, spec.recipe, key,
                               preferred_element_type=spec.preferred_element_type,
                               gemm_name=spec.gemm_name, operand_dtypes=spec.operand_dtypes)
    return _differentiable_gemm(g, b, key, spec, straight_through)


def _policy_dot_bwd(st: _Static, res, g):
    lhs, rhs, key = res
    _, kd, kw = split_key(key)
    (d_dims, d_perm), (w_dims, w_perm) = backward_dimension_numbers(
        st.dims, len(lhs.shape), len(rhs.shape))
    pet = st.preferred_element_type
    # With operand_dtype the primals are cast inside: the residual operand of each
    # backward GEMM is cast as in the forward (the cotangent g is the cast GEMM's),
    # and each cotangent is the cast operand's, cast back as the cast's transpose does.
    d = st.operand_dtype
    cast = None if d is None else (None, d)
    dspec = _GemmSpec(d_dims, st.policy.dgrad, st.precision, pet, "dgrad",
                      _cotangent_sharding(lhs, d_perm), cast)
    dlhs = _backward_gemm(g, rhs, kd, dspec, st.straight_through)
    _observed(st, dspec, g, rhs, kd, dlhs, d_perm)
    dlhs = _cast_to(jnp.transpose(dlhs, d_perm), d).astype(_primal_dtype(lhs))
    wspec = _GemmSpec(w_dims, st.policy.wgrad, st.precision, pet, "wgrad",
                      _cotangent_sharding(rhs, w_perm), cast)
    drhs = _backward_gemm(g, lhs, kw, wspec, st.straight_through)
    _observed(st, wspec, g, lhs, kw, drhs, w_perm)
    drhs = _cast_to(jnp.transpose(drhs, w_perm), d).astype(_primal_dtype(rhs))
    return dlhs, drhs, None


_policy_dot.defvjp(_policy_dot_fwd, _policy_dot_bwd)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DotGeneralCall:
    """One intercepted quantized ``dot_general`` call, as an observer's hook gets it.

    Attributes:
      lhs, rhs: the call's operands (float arrays, any rank).
      key: the call's PRNG key, or None when the policy needs none.
      dims: the normalized dimension numbers (``mxjax.dimensions.Dims``).
      policy: the policy (its ``fprop``, ``dgrad``, ``wgrad`` GemmRecipes).

    ``call(lhs, rhs, key, on_gemm=None)`` runs it: the quantized dot_general with
    its custom VJP, closed over static values only (so a hook may put it under
    its own custom VJP, passing the arrays through); ``on_gemm(record)`` gets a
    :class:`~mxjax.gemm_record.GemmRecord` per GEMM as it runs.
    """

    lhs: jax.Array
    rhs: jax.Array
    key: jax.Array | None
    dims: Dims
    policy: PolicyRecipes
    static: _Static = dataclasses.field(repr=False)  # the custom_vjp's static arguments

    def __call__(self, lhs, rhs, key, *, on_gemm: Callable[[GemmRecord], None] | None = None):
        if on_gemm is not None and not callable(on_gemm):
            raise TypeError(f"on_gemm: expected a callable or None, got {on_gemm!r}")
        return _policy_dot(lhs, rhs, key, self.static._replace(on_gemm=on_gemm))


def _check_operand(x: Any, name: str) -> jax.Array:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name}: mxjax.dot_general needs a floating-point array, got dtype {x.dtype}")
    return x


def _check_operand_dtype(dtype) -> np.dtype:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not any(dt == d for d in FLOAT_DTYPES):
        raise TypeError(
            f"operand_dtype: expected None, float32, bfloat16 or float16, got {dtype!r}")
    return dt


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    policy: PolicyRecipes,
    key: jax.Array | None = None,
    operand_dtype=None,
    **kwargs,
) -> jax.Array:
    """``jax.lax.dot_general`` whose fprop, dgrad and wgrad follow `policy`.

    Args:
      lhs: float array (X in the GEMM table), any rank.
      rhs: float array (W), any rank.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))`` exactly as for ``lax.dot_general`` (any batch dims, several
        or non-trailing contracting dims).
      precision: used by pass-through GEMMs; quantized GEMMs accumulate in f32
        with operands they choose per lowering platform (CPU: dequantized f32 at
        HIGHEST; GPU/TPU: bf16 at DEFAULT where exact, docs/NUMERICS.md).
      preferred_element_type: output dtype, as for ``lax.dot_general``.
      policy: a ``mxjax.PrecisionPolicy`` (``mxjax.dot_general`` also takes a preset
        name and resolves it before calling this).
      key: PRNG key; required when ``policy.needs_key``. Split per GEMM.
      operand_dtype: None, or a float dtype (float32, bfloat16, float16) both
        operands are cast to first: the call is then, bit for bit in its value
        and its cotangents, ``dot_general(lhs.astype(operand_dtype),
        rhs.astype(operand_dtype), ...)``, but the casts are left to the
        quantizers, which can read e.g. an f32 master weight directly instead of
        a materialized bf16 copy (the TPU kernel rounds it to bf16 itself).
        Observers (`observe`) see the cast operands.
      **kwargs: ``out_sharding`` (the only sharding argument ``lax.dot_general``
        takes in jax 0.11.2 and 0.12) is kept, with ``lax.dot_general``'s
        semantics: forwarded to it by pass-through GEMMs; quantized GEMMs under a
        mesh with explicit axes (``jax.set_mesh``) give the result the sharding
        ``lax.dot_general`` would (and raise its error where that is ambiguous),
        and the backward GEMMs give each cotangent its primal's sharding, as
        JAX's transpose rule does; without explicit axes the result is resharded
        with ``jax.sharding.reshard``. Others are ignored.
    Returns:
      Array with ``lax.dot_general``'s shape and dtype. Its cotangents have the
      primals' dtypes.
    Raises:
      TypeError: when differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``)
        under a quantizing policy; reverse mode, ``jax.grad`` of ``jax.grad`` and
        ``jax.jvp`` of ``jax.grad`` work (second derivatives of quantized GEMMs
        use the straight-through rule; docs/NUMERICS.md).
    """
    policy = check_policy_recipes(policy)
    lhs = _check_operand(lhs, "lhs")
    rhs = _check_operand(rhs, "rhs")
    if operand_dtype is not None:
        operand_dtype = _check_operand_dtype(operand_dtype)
        if policy.is_passthrough or _HOOK.get() is not None:
            lhs, rhs, operand_dtype = lhs.astype(operand_dtype), rhs.astype(operand_dtype), None
        elif lhs.dtype == operand_dtype and rhs.dtype == operand_dtype:
            operand_dtype = None
    dims = normalize_dimension_numbers(dimension_numbers, lhs.shape, rhs.shape)
    if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type,
                                                                 jnp.floating):
        raise TypeError(
            "preferred_element_type: must be a floating dtype or None, got "
            f"{preferred_element_type}"
        )
    if policy.is_passthrough:
        out_sharding = kwargs.get("out_sharding")
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return lax.dot_general(lhs, rhs, dims.as_lax(), precision=precision,
                               preferred_element_type=preferred_element_type, **extra)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not any(x.dtype == d for d in FLOAT_DTYPES):
            raise TypeError(
                f"{name}: quantized GEMMs support float32, bfloat16 and float16, got {x.dtype}"
            )
    if policy.needs_key and key is None:
        raise ValueError(
            f"key: policy {policy.name or ''!s} uses stochastic rounding or a randomized "
            "Hadamard and needs a PRNG key (key=jax.random.key(...)); under mxjax.nn.wrap it "
            "comes from the 'mxjax' RNG stream"
        )
    if not policy.needs_key:
        key = None
    st = _Static(dims, precision, None if preferred_element_type is None
                 else jnp.dtype(preferred_element_type), policy,
                 kwargs.get("out_sharding"), operand_dtype=operand_dtype)
    hook = _HOOK.get()  # None unless an observer (mxjax.diagnostics) is active
    try:
        if hook is not None:
            call = DotGeneralCall(lhs=lhs, rhs=rhs, key=key, dims=dims, policy=policy,
                                  static=st._replace(straight_through=False))
            out = hook(call)
        else:
            out = _policy_dot(lhs, rhs, key, st)
    except TypeError as e:  # JAX's own message, raised here when jvp runs eagerly
        if "forward-mode" in str(e):
            raise TypeError(_forward_mode_message(policy)) from e
        raise
    # Under jit JAX's error would come only when the program is lowered; a tangent
    # attached to the output here means this call is being forward-differentiated.
    if isinstance(out, JVPTracer):
        raise TypeError(_forward_mode_message(policy))
    return out


def _forward_mode_message(policy: PolicyRecipes) -> str:
    return (
        f"mxjax.dot_general under policy {getattr(policy, 'name', None) or policy!s} cannot be "
        "differentiated in forward mode (jax.jvp, jax.jacfwd, jax.linearize): its gradient is "
        "defined by the policy's quantized dgrad/wgrad GEMMs, which are not the transpose of "
        "any tangent map. Use reverse mode (jax.grad, jax.vjp, jax.jacrev); for Hessian-vector "
        "products use jax.jvp of jax.grad (forward-over-reverse) or jax.grad of jax.grad, which "
        "are supported (see docs/NUMERICS.md, 'Second-order derivatives'); or the "
        "'passthrough' policy for exact forward-mode derivatives."
    )

