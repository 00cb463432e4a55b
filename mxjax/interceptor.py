"""The dot_general interceptor: fprop, dgrad and wgrad each under their own recipe.

``dot_general(lhs, rhs, dimension_numbers, ..., policy=..., key=...)`` is a
drop-in for ``jax.lax.dot_general`` with a ``jax.custom_vjp``:

* fprop computes ``dot_general(lhs, rhs, dims)`` under ``policy.fprop``;
* dgrad computes the lhs cotangent as ``dot_general(g, rhs, dims_l)`` under
  ``policy.dgrad`` and wgrad the rhs cotangent as ``dot_general(g, lhs, dims_r)``
  under ``policy.wgrad``, where ``dims_l``/``dims_r`` and the final transposes
  follow JAX's transpose rule for ``dot_general`` (``_dot_general_transpose_lhs``
  / ``_rhs``), for any dimension numbers.

A quantized GEMM ``dot_general(a, b, ((ca, cb), (ba, bb)))`` is emulated as:
transpose each operand to ``(batch..., free, contraction)`` and flatten its free
axes and its contracting axes (``ca[i]`` pairs with ``cb[i]``; the flattened
contraction is row-major in that order), upcast to f32, zero-pad the
contraction to a multiple of the Hadamard size (also when it is shorter than
one Hadamard block) and rotate both operands (if the recipe has a Hadamard),
quantize each along the contraction (the last axis), then one
``lax.dot_general`` with f32 accumulation, reshaped back to
``lax.dot_general``'s layout and cast to its result dtype. The GEMM's form
depends on the platform it is lowered for: XLA:CPU gets dequantized f32
operands at HIGHEST with each stage materialized; GPUs/TPUs get bf16 operands
at DEFAULT (exact, see docs/NUMERICS.md) with per-tensor scales applied to the
f32 result and no CPU-only barriers.

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
import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.interpreters.ad import JVPTracer

from mxjax import formats as F
from mxjax._platform import cpu_barrier, cpu_or_accelerator
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import (
    FLOAT_DTYPES,
    SR_UNSCALE,
    fake_quantize,
    fake_quantize_parts,
    quantize,
)
from mxjax.recipes import BACKENDS, GemmRecipe, PolicyRecipes, check_policy_recipes
from mxjax.rotation import fixed_signs, hadamard, random_signs

__all__ = [
    "Dims",
    "backward_dimension_numbers",
    "canonical_operands",
    "dot_general",
    "gemm",
    "normalize_dimension_numbers",
    "observe",
    "quantizer_operands",
    "split_key",
]


class Dims(NamedTuple):
    """Normalized dimension numbers ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))."""

    contract: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]

    def as_lax(self):
        return (self.contract, self.batch)


# --------------------------------------------------------------------------- #
# Dimension numbers
# --------------------------------------------------------------------------- #
def _as_int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(
            f"dimension_numbers: {what} must be a sequence of ints, got {value!r} "
            "(expected ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)))"
        )
    out = []
    for v in value:
        if isinstance(v, bool):
            raise TypeError(f"dimension_numbers: {what} must hold ints, got {v!r}")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"dimension_numbers: {what} must hold ints, got {v!r}") from None
    return tuple(out)


def normalize_dimension_numbers(dimension_numbers: Any, lhs_shape: Sequence[int],
                                rhs_shape: Sequence[int]) -> Dims:
    """Validates ``dimension_numbers`` against the operand shapes.

    Raises:
      TypeError / ValueError naming ``dimension_numbers`` on a bad structure,
      out-of-range or repeated axes, or mismatched contraction/batch sizes.
    """
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise TypeError(
            "dimension_numbers: expected ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None
    lc, rc = _as_int_tuple(lc, "lhs_contracting"), _as_int_tuple(rc, "rhs_contracting")
    lb, rb = _as_int_tuple(lb, "lhs_batch"), _as_int_tuple(rb, "rhs_batch")
    if len(lc) != len(rc):
        raise ValueError(
            f"dimension_numbers: {len(lc)} lhs contracting dims {lc} but {len(rc)} rhs "
            f"contracting dims {rc}"
        )
    if len(lb) != len(rb):
        raise ValueError(
            f"dimension_numbers: {len(lb)} lhs batch dims {lb} but {len(rb)} rhs batch dims {rb}"
        )
    for side, shape, c, b in (("lhs", lhs_shape, lc, lb), ("rhs", rhs_shape, rc, rb)):
        nd = len(shape)
        for a in c + b:
            if not 0 <= a < nd:
                raise ValueError(
                    f"dimension_numbers: {side} axis {a} is out of range for rank {nd} "
                    f"(shape {tuple(shape)})"
                )
        if len(set(c + b)) != len(c + b):
            raise ValueError(
                f"dimension_numbers: {side} contracting {c} and batch {b} axes must be distinct"
            )
    for i, (a, b) in enumerate(zip(lc, rc)):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(
                f"dimension_numbers: contracting sizes differ: lhs axis {a} has "
                f"{lhs_shape[a]}, rhs axis {b} has {rhs_shape[b]} (lhs shape {tuple(lhs_shape)}, "
                f"rhs shape {tuple(rhs_shape)})"
            )
    for a, b in zip(lb, rb):
        if lhs_shape[a] != rhs_shape[b]:
            raise ValueError(
                f"dimension_numbers: batch sizes differ: lhs axis {a} has {lhs_shape[a]}, "
                f"rhs axis {b} has {rhs_shape[b]}"
            )
    return Dims((lc, rc), (lb, rb))


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = set().union(*map(set, removed))
    return [i for i in range(n) if i not in gone]


def _ranges_like(*xs: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for x in xs:
        out.append(list(range(start, start + len(x))))
        start += len(x)
    return out


def _transpose_dims(dims: Dims, x_ndim: int, y_ndim: int, swap_ans: bool
                    ) -> tuple[Dims, tuple[int, ...]]:
    """JAX's transpose rule for the x operand of dot_general(x, y, dims).

    The cotangent of x is ``transpose(dot_general(g, y, out_dims), out_perm)``.
    With ``swap_ans`` the answer g has y's free axes before x's (used for the rhs).
    """
    (x_contract, y_contract), (x_batch, y_batch) = dims
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    out_dims = Dims((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(np.asarray(x_contract, dtype=int),
                                          np.argsort(np.asarray(y_contract, dtype=int))))
    unsorted_axes = list(x_batch) + x_kept + x_contract_sorted_by_y
    out_perm = tuple(int(i) for i in np.argsort(unsorted_axes))
    return out_dims, out_perm


def backward_dimension_numbers(dims: Dims, lhs_ndim: int, rhs_ndim: int):
    """Dimension numbers and output permutations of the two backward GEMMs.

    Returns:
      ``((dgrad_dims, dgrad_perm), (wgrad_dims, wgrad_perm))``: the lhs cotangent
      is ``transpose(dot_general(g, rhs, dgrad_dims), dgrad_perm)`` and the rhs
      cotangent ``transpose(dot_general(g, lhs, wgrad_dims), wgrad_perm)``.
    """
    dgrad = _transpose_dims(dims, lhs_ndim, rhs_ndim, swap_ans=False)
    (lc, rc), (lb, rb) = dims
    swapped = Dims((rc, lc), (rb, lb))
    wgrad = _transpose_dims(swapped, rhs_ndim, lhs_ndim, swap_ans=True)
    return dgrad, wgrad


# --------------------------------------------------------------------------- #
# One GEMM
# --------------------------------------------------------------------------- #
def _to_canonical(x: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> jax.Array:
    """x -> (batch..., prod(free), prod(contract)), f32."""
    free = _remaining(x.ndim, batch, contract)
    perm = tuple(batch) + tuple(free) + tuple(contract)
    if perm != tuple(range(x.ndim)):
        x = jnp.transpose(x, perm)
    bshape = tuple(x.shape[: len(batch)])
    f = math.prod(x.shape[len(batch): len(batch) + len(free)])
    k = math.prod(x.shape[len(batch) + len(free):])
    return x.reshape(bshape + (f, k)).astype(jnp.float32)


def canonical_operands(a: jax.Array, b: jax.Array, dims: Dims) -> tuple[jax.Array, jax.Array]:
    """Both operands of ``dot_general(a, b, dims)`` in the canonical layout, f32.

    Returns ``(a3, b3)``: f32 ``[batch..., Fa, K]`` and ``[batch..., Fb, K]``
    (``mxjax.layout``), free and contracting axes flattened in order.
    """
    (ca, cb), (ba, bb) = dims
    return _to_canonical(a, ba, ca), _to_canonical(b, bb, cb)


def _prepare_operand(x: jax.Array, recipe, key) -> jax.Array:
    if recipe.is_passthrough:
        return x
    return fake_quantize(x, recipe.fmt, axis=-1, **recipe.quantizer_kwargs(key))


def _prepare_operand_parts(x: jax.Array, recipe, key):
    """(values, per-tensor f32 factors): the operand is ``values * factors[0] * ...``.

    The factors (NVFP4's and per-tensor FP8's tensor scale, the 4/3 SR unscale)
    are left out of ``values`` so that they can be applied to the GEMM's f32 result.
    """
    values, tensor_scale = fake_quantize_parts(
        x, recipe.fmt, axis=-1, scale_rule=recipe.scale_rule, rounding=recipe.rounding,
        key=key if recipe.needs_key else None, sr_prescale=recipe.sr_prescale)
    factors = () if tensor_scale is None else (tensor_scale,)
    if recipe.sr_prescale:
        factors += (jnp.float32(SR_UNSCALE),)
    return values, factors


# bf16 (and f32) normal exponents start at -126; bf16 subnormals end at 2^-133.
_BF16_MIN_NORMAL_EXP = -126
_BF16_MIN_SUBNORMAL_EXP = -133
_BF16_SIGNIFICANT_BITS = 8


class OperandRange(NamedTuple):
    """What the emulated GEMM's operand values (per-tensor factors left out) can be.

    ``min_exp``: log2 of the smallest nonzero magnitude; ``significant_bits``:
    the most significant bits of any value. None for a pass-through operand
    (arbitrary f32 values).
    """

    min_exp: int | None
    significant_bits: int | None

    @property
    def bf16_exact(self) -> bool:
        """Every value is a bf16 value (subnormals included)."""
        return (self.min_exp is not None and self.min_exp >= _BF16_MIN_SUBNORMAL_EXP
                and self.significant_bits <= _BF16_SIGNIFICANT_BITS)

    @property
    def bf16_normal(self) -> bool:
        """Every nonzero value is a bf16 normal (nothing a flush-to-zero unit can drop)."""
        return self.bf16_exact and self.min_exp >= _BF16_MIN_NORMAL_EXP


def operand_range(recipe) -> OperandRange:
    """Trace-time range of an operand's `fake_quantize_parts` values, from its format.

    E8M0 formats: element grid times 2^s, s in [-127, 127]; the top end above the
    f32 range is already Inf in f32 (and the same Inf in bf16: a finite f32 with
    at most 8 significant bits is a bf16 value). NVFP4: E2M1 times an E4M3 block
    scale (the tensor scale is a factor). Per-tensor FP8: the element grid.
    """
    fmt = recipe.fmt
    if fmt.is_passthrough:
        return OperandRange(None, None)
    elem = fmt.element
    elem_min_exp = int(math.log2(elem.min_subnormal))
    if fmt.scale == "e8m0":
        return OperandRange(elem_min_exp - 127, elem.mbits + 1)
    if fmt.scale == "e4m3":
        scale_elem = F.E4M3
        return OperandRange(elem_min_exp + int(math.log2(scale_elem.min_subnormal)),
                            elem.mbits + 1 + scale_elem.mbits + 1)
    return OperandRange(elem_min_exp, elem.mbits + 1)


def accelerator_operand_dtype(recipe: GemmRecipe):
    """The dtype of a quantized GEMM's operands on GPU/TPU, decided at trace time.

    bf16 (at DEFAULT precision, f32 accumulation) when every value of both
    operands is exactly a bf16 value (`OperandRange.bf16_exact`): MXFP4, NVFP4,
    per-tensor FP8. Otherwise f32 at HIGHEST, the explicit fallback documented in
    docs/NUMERICS.md: MXFP8 (E4M3/E5M2 x E8M0 reaches 2^-136 / 2^-143, below
    bf16's 2^-133) and a pass-through operand inside a quantized GEMM.
    """
    if operand_range(recipe.lhs).bf16_exact and operand_range(recipe.rhs).bf16_exact:
        return jnp.bfloat16
    return jnp.float32


def _rotate(a3: jax.Array, b3: jax.Array, recipe: GemmRecipe, k_had):
    """Applies the recipe's Hadamard to both canonical operands along K (if any)."""
    had = recipe.hadamard
    if had is None:
        return a3, b3
    h = had.block_size
    kdim = a3.shape[-1]
    # A contraction shorter than h (or not a multiple of it) is zero-padded:
    # both operands get the same zeros, so the rotation still cancels exactly.
    pad = (-kdim) % h
    if pad:
        widths = [(0, 0)] * (a3.ndim - 1) + [(0, pad)]
        a3, b3 = jnp.pad(a3, widths), jnp.pad(b3, widths)
    if had.randomized:
        signs = random_signs(k_had, h)
    elif had.seed is not None:
        signs = fixed_signs(had.seed, h)
    else:
        signs = None
    # On CPU the barrier keeps XLA from fusing the butterflies into the
    # quantizer's block reductions, which recomputes them (measured 4x slower).
    # One barrier per operand, so neither operand's program depends on the other.
    return (cpu_barrier(hadamard(a3, h, axis=-1, signs=signs)),
            cpu_barrier(hadamard(b3, h, axis=-1, signs=signs)))


def split_key(key):
    """Three keys from one, or three Nones for None.

    The call's key gives (fprop, dgrad, wgrad); each GEMM's key gives (lhs
    rounding, rhs rounding, Hadamard signs).
    """
    if key is None:
        return None, None, None
    k0, k1, k2 = jax.random.split(key, 3)
    return k0, k1, k2


def quantizer_operands(a3: jax.Array, b3: jax.Array, recipe: GemmRecipe, key):
    """One GEMM's operands as its backend hands them to the quantizer.

    Args:
      a3, b3: the canonical operands (:func:`canonical_operands`).
      recipe: the GEMM's recipe.
      key: the GEMM's key (ignored unless the recipe needs one).
    Returns:
      ``(a3, b3, lhs_key, rhs_key)``: the operands rotated by the recipe's
      Hadamard along K (zero-padded to its size) when it has one, and the keys
      of the two roundings (None unless needed).
    """
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    a3, b3 = _rotate(a3, b3, recipe, k_had)
    return a3, b3, k_lhs, k_rhs


def _cpu_gemm(a3, b3, recipe: GemmRecipe, k_lhs, k_rhs):
    """XLA:CPU form: dequantized f32 operands, each materialized, one f32 GEMM at HIGHEST."""
    aq = cpu_barrier(_prepare_operand(a3, recipe.lhs, k_lhs))
    bq = cpu_barrier(_prepare_operand(b3, recipe.rhs, k_rhs))
    return lax.dot_general(aq, bq, canonical_dimension_numbers(a3.ndim - 2),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _accelerator_gemm(a3, b3, recipe: GemmRecipe, k_lhs, k_rhs):
    """GPU/TPU form: no barriers; bf16 operands at DEFAULT with f32 accumulation.

    Per-tensor factors are applied to the f32 result, lhs's then rhs's, one
    multiply each. Formats whose values bf16 cannot hold fall back to f32 at
    HIGHEST (`accelerator_operand_dtype`).
    """
    dims = canonical_dimension_numbers(a3.ndim - 2)
    if accelerator_operand_dtype(recipe) != jnp.bfloat16:
        aq = _prepare_operand(a3, recipe.lhs, k_lhs)
        bq = _prepare_operand(b3, recipe.rhs, k_rhs)
        return lax.dot_general(aq, bq, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    av, a_factors = _prepare_operand_parts(a3, recipe.lhs, k_lhs)
    bv, b_factors = _prepare_operand_parts(b3, recipe.rhs, k_rhs)
    out = lax.dot_general(av.astype(jnp.bfloat16), bv.astype(jnp.bfloat16), dims,
                          precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
    for factor in a_factors + b_factors:
        out = out * factor
    return out


def _xla_gemm(a3: jax.Array, b3: jax.Array, recipe: GemmRecipe, key, gemm_name: str) -> jax.Array:
    """The XLA reference backend on canonical operands.

    The program depends on the platform it is lowered for (not on the tracing
    machine): XLA:CPU gets `_cpu_gemm`, GPUs and TPUs `_accelerator_gemm`
    (docs/NUMERICS.md, "Emulated GEMM").

    Args:
      a3: f32 [batch..., Fa, K]; b3: f32 [batch..., Fb, K] (same batch shape).
      recipe: the GEMM's recipe.
      key: the GEMM's key (None when the recipe needs none); split into (lhs
        rounding, rhs rounding, Hadamard signs).
      gemm_name: 'fprop', 'dgrad' or 'wgrad' (for backends' error messages).
    Returns:
      f32 [batch..., Fa, Fb].
    """
    a3, b3, k_lhs, k_rhs = quantizer_operands(a3, b3, recipe, key)
    return cpu_or_accelerator(
        a3, b3,
        cpu=functools.partial(_cpu_gemm, recipe=recipe, k_lhs=k_lhs, k_rhs=k_rhs),
        accelerator=functools.partial(_accelerator_gemm, recipe=recipe, k_lhs=k_lhs,
                                      k_rhs=k_rhs))


def _kernel_gemm(a3: jax.Array, b3: jax.Array, recipe: GemmRecipe, key,
                 gemm_name: str) -> jax.Array:
    """Kernel backends ('pallas', 'pallas_fp8', 'triton', 'auto'): packed operands + mx_dot.

    Same operands, keys and rotation as `_xla_gemm`; the quantized operands are
    packed (`quantize`) and contracted by `mxjax.kernels.mx_dot`. An explicit
    kernel backend that cannot run here, or does not implement the recipe's
    formats, raises; 'auto' picks the fastest correct backend for the device.
    """
    from mxjax import kernels  # imported here: keeps `import mxjax` free of Pallas

    backend = kernels.backend_for_formats(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt,
                                          where=gemm_name)
    if backend == "xla":
        return _xla_gemm(a3, b3, recipe, key, gemm_name)
    a3, b3, k_lhs, k_rhs = quantizer_operands(a3, b3, recipe, key)

    def q(x, op, k):
        return quantize(x, op.fmt, axis=-1, **op.quantizer_kwargs(k))

    return kernels.mx_dot(q(a3, recipe.lhs, k_lhs), q(b3, recipe.rhs, k_rhs), backend=backend)


# Backend name (mxjax.recipes.BACKENDS) -> function(a3, b3, recipe, key, gemm_name)
# -> f32 [batch..., Fa, Fb]. Every name but 'xla' runs through mxjax.kernels.
_BACKEND_FNS: dict[str, Callable[..., jax.Array]] = {
    "xla": _xla_gemm,
    **{name: _kernel_gemm for name in BACKENDS if name != "xla"},
}


def _backend_fn(recipe: GemmRecipe) -> Callable[..., jax.Array]:
    """The one place where a GEMM's backend is chosen."""
    try:
        return _BACKEND_FNS[recipe.backend]
    except KeyError:
        raise ValueError(
            f"backend: {recipe.backend!r} has no implementation registered; "
            f"available: {sorted(_BACKEND_FNS)}"
        ) from None


def gemm(a: jax.Array, b: jax.Array, dims: Dims, recipe: GemmRecipe, key, *,
         precision=None, preferred_element_type=None, gemm_name: str = "gemm",
         out_sharding=None) -> jax.Array:
    """One GEMM ``dot_general(a, b, dims)`` under `recipe` (no custom gradient).

    Pass-through recipes call ``lax.dot_general(a, b, dims, precision,
    preferred_element_type, out_sharding=...)`` unchanged. Otherwise the result
    is computed in f32 (see the module docstring), cast to ``lax.dot_general``'s
    result dtype and, given ``out_sharding``, resharded to it with
    ``jax.sharding.reshard`` (which, like ``lax.dot_general``'s argument, binds
    explicit mesh axes and leaves auto axes to the partitioner).
    """
    if recipe.is_passthrough:
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return lax.dot_general(a, b, dims.as_lax(), precision=precision,
                               preferred_element_type=preferred_element_type, **extra)
    out_dtype = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims.as_lax(),
                          preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype),
    ).dtype
    (ca, cb), (ba, bb) = dims
    a3, b3 = canonical_operands(a, b, dims)
    out = _backend_fn(recipe)(a3, b3, recipe, key if recipe.needs_key else None, gemm_name)
    fa = [a.shape[i] for i in _remaining(a.ndim, ba, ca)]
    fb = [b.shape[i] for i in _remaining(b.ndim, bb, cb)]
    out = out.reshape(tuple(a.shape[i] for i in ba) + tuple(fa) + tuple(fb)).astype(out_dtype)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out


# --------------------------------------------------------------------------- #
# The observer hook
# --------------------------------------------------------------------------- #
# hook(call, lhs, rhs, key, dims, policy) -> call(lhs, rhs, key). `call` is the
# quantized dot_general with its custom VJP (it closes over static values only);
# `dims` are the normalized dimension numbers, `key` the call's key (None when
# the policy needs none). Context-local: set only inside `observe`.
_HOOK: contextvars.ContextVar[Callable[..., jax.Array] | None] = contextvars.ContextVar(
    "mxjax_interceptor_hook", default=None)


@contextlib.contextmanager
def observe(hook: Callable[..., jax.Array]):
    """Routes every quantized ``dot_general`` traced inside the block through `hook`.

    The one extension point of the interceptor (``mxjax.diagnostics`` uses it to
    collect GEMM statistics). Once per quantized call, at trace time, the
    interceptor calls ``hook(call, lhs, rhs, key, dims, policy)`` instead of
    ``call(lhs, rhs, key)``; the hook must return that value (it may wrap
    ``call`` in its own custom VJP to see the cotangent). Pass-through policies
    never reach it. Outside the block nothing is added to the traced program.
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
    # derivatives. Off while mxjax.diagnostics collects (first-order only): a custom_jvp
    # traces its body apart, where the GEMM's recorded stats could not get out.
    straight_through: bool = True


class _GemmSpec(NamedTuple):
    """The static part of one GEMM of the custom_vjp (hashable: a nondiff argument)."""

    dims: Dims
    recipe: GemmRecipe
    precision: Any
    preferred_element_type: Any
    gemm_name: str


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
                preferred_element_type=spec.preferred_element_type, gemm_name=spec.gemm_name)


@functools.partial(_ste_gemm.defjvp, symbolic_zeros=True)
def _ste_gemm_jvp(spec: _GemmSpec, primals, tangents):
    a, b, key = primals
    ta, tb, _ = tangents
    out = _ste_gemm(a, b, key, spec)
    kw = {"precision": spec.precision, "preferred_element_type": spec.preferred_element_type}
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
                    gemm_name=spec.gemm_name)
    return _ste_gemm(a, b, key if spec.recipe.needs_key else None, spec)


def _fprop(lhs, rhs, key, st: _Static):
    kf, _, _ = split_key(key)
    spec = _GemmSpec(st.dims, st.policy.fprop, st.precision, st.preferred_element_type,
                     "fprop")
    out = _differentiable_gemm(lhs, rhs, kf, spec, st.straight_through)
    if st.out_sharding is not None:
        out = jax.sharding.reshard(out, st.out_sharding)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _policy_dot(lhs, rhs, key, st: _Static):
    return _fprop(lhs, rhs, key, st)


def _policy_dot_fwd(lhs, rhs, key, st: _Static):
    return _fprop(lhs, rhs, key, st), (lhs, rhs, key)


def _policy_dot_bwd(st: _Static, res, g):
    lhs, rhs, key = res
    _, kd, kw = split_key(key)
    (d_dims, d_perm), (w_dims, w_perm) = backward_dimension_numbers(st.dims, lhs.ndim, rhs.ndim)
    pet = st.preferred_element_type
    dspec = _GemmSpec(d_dims, st.policy.dgrad, st.precision, pet, "dgrad")
    dlhs = _differentiable_gemm(g, rhs, kd, dspec, st.straight_through)
    dlhs = jnp.transpose(dlhs, d_perm).astype(lhs.dtype)
    wspec = _GemmSpec(w_dims, st.policy.wgrad, st.precision, pet, "wgrad")
    drhs = _differentiable_gemm(g, lhs, kw, wspec, st.straight_through)
    drhs = jnp.transpose(drhs, w_perm).astype(rhs.dtype)
    return dlhs, drhs, None


_policy_dot.defvjp(_policy_dot_fwd, _policy_dot_bwd)


def _check_operand(x: Any, name: str) -> jax.Array:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name}: mxjax.dot_general needs a floating-point array, got dtype {x.dtype}")
    return x


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    policy: PolicyRecipes,
    key: jax.Array | None = None,
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
      **kwargs: ``out_sharding`` (the only sharding argument ``lax.dot_general``
        takes in jax 0.11.2 and 0.12) is kept: forwarded to ``lax.dot_general``
        by pass-through GEMMs, applied to the result with
        ``jax.sharding.reshard`` by quantized ones. Others are ignored.
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
                 kwargs.get("out_sharding"))
    hook = _HOOK.get()  # None unless an observer (mxjax.diagnostics) is active
    try:
        if hook is not None:
            st = st._replace(straight_through=False)
            out = hook(lambda a, b, k: _policy_dot(a, b, k, st), lhs, rhs, key, dims, policy)
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
        "are supported (see docs/NUMERICS.md, 'Second-order derivatives'); or the 'bf16' "
        "policy for exact forward-mode derivatives."
    )
