"""One GEMM under a recipe: canonical operands, rotation, quantization, per-platform form.

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
f32 result and no CPU-only barriers. Kernel backends ('pallas', 'pallas_fp8',
'triton', 'auto') take the packed operands instead.

Keys: each GEMM's key is split into three (lhs rounding, rhs rounding,
Hadamard signs) by :func:`split_key`. No custom gradient here: the
interceptor (``mxjax.interceptor``) puts three of these GEMMs under one
``custom_vjp``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from mxjax._platform import cpu_barrier, cuda_or_other, per_platform
from mxjax.dimensions import Dims, free_axes
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import fake_quantize_parts_with, fake_quantize_with, quantize_with
from mxjax.recipes import BACKENDS, GemmRecipe
from mxjax.rotation import fixed_signs, hadamard, random_signs
from mxjax.routes import fp8_units, in_place, xla_fp4, xla_fp8
from mxjax.routes.in_place import cast_operands
from mxjax.scaling import SR_UNSCALE, OperandRange

__all__ = [
    "OperandRange",
    "accelerator_operand_dtype",
    "canonical_operands",
    "gemm",
    "has_explicit_axes",
    "operand_range",
    "quantizer_operands",
    "rotation_signs",
    "split_key",
    "takes_f8_on_cuda",
]


# --------------------------------------------------------------------------- #
# One GEMM
# --------------------------------------------------------------------------- #
def _to_canonical(x: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> jax.Array:
    """x -> (batch..., prod(free), prod(contract)), f32."""
    free = free_axes(x.ndim, batch, contract)
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
    return fake_quantize_with(x, recipe, -1, key=key)


def _prepare_operand_parts(x: jax.Array, recipe, key):
    """(values, per-tensor f32 factors): the operand is ``values * factors[0] * ...``.

    The factors (NVFP4's and per-tensor FP8's tensor scale, the 4/3 SR unscale)
    are left out of ``values`` so that they can be applied to the GEMM's f32 result.
    """
    values, tensor_scale = fake_quantize_parts_with(x, recipe, -1, key=key)
    factors = () if tensor_scale is None else (tensor_scale,)
    if recipe.sr_prescale:
        factors += (jnp.float32(SR_UNSCALE),)
    return values, factors


def operand_range(recipe) -> OperandRange:
    """Trace-time range of an operand's `fake_quantize_parts` values, from its format.

    The scaling scheme's range (``mxjax.scaling``: E8M0 formats: element grid
    times 2^s, s in [-127, 127]; NVFP4: E2M1 times an E4M3 block scale, the
    tensor scale being a factor; per-tensor FP8: the element grid); a
    pass-through operand can be any f32 value.
    """
    if recipe.is_passthrough:
        return OperandRange(None, None)
    return recipe.scheme.operand_range()


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
    signs = rotation_signs(had, k_had)
    # On CPU the barrier keeps XLA from fusing the butterflies into the
    # quantizer's block reductions, which recomputes them (measured 4x slower).
    # One barrier per operand, so neither operand's program depends on the other.
    return (cpu_barrier(hadamard(a3, h, axis=-1, signs=signs)),
            cpu_barrier(hadamard(b3, h, axis=-1, signs=signs)))


def rotation_signs(had, k_had):
    """The ±1 f32[h] sign vector a GEMM's Hadamard uses, or None (plain H).

    Randomized: drawn from ``k_had`` (the GEMM key's third split); a fixed seed:
    ``mxjax.rotation.fixed_signs``; otherwise None.
    """
    if had.randomized:
        return random_signs(k_had, had.block_size)
    if had.seed is not None:
        return fixed_signs(had.seed, had.block_size)
    return None


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


def _layout_free(recipe: GemmRecipe) -> bool:
    """Whether both operands' quantized values do not depend on their layout.

    Per-tensor FP8 without a rotation or uniforms: the scale is the whole tensor's
    amax, the rounding elementwise, so quantizing an operand before or after the
    transpose into the canonical layout gives the same values.
    """
    return (recipe.lhs.fmt.is_per_tensor and recipe.rhs.fmt.is_per_tensor
            and recipe.hadamard is None and not recipe.needs_key)


def _canonical_cpu_form(a, b, dims: Dims, recipe: GemmRecipe, k_lhs, k_rhs, k_had):
    if _layout_free(recipe):
        # Quantized where they are, then laid out: the same operand quantized by two
        # GEMMs of a layer (X by fprop and wgrad, W by fprop and dgrad, dY by dgrad and
        # wgrad) is then the same computation, which XLA computes once.
        aq = cpu_barrier(_prepare_operand(a.astype(jnp.float32), recipe.lhs, None))
        bq = cpu_barrier(_prepare_operand(b.astype(jnp.float32), recipe.rhs, None))
        a3, b3 = canonical_operands(aq, bq, dims)
        return lax.dot_general(a3, b3, canonical_dimension_numbers(a3.ndim - 2),
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    a3, b3 = _rotate(*canonical_operands(a, b, dims), recipe, k_had)
    return _cpu_gemm(a3, b3, recipe, k_lhs, k_rhs)


def _in_place_mx(recipe: GemmRecipe) -> bool:
    """Whether the accelerator form quantizes the operands in place (MX formats, bf16-exact)."""
    return (recipe.lhs.fmt.scale == "e8m0" and recipe.rhs.fmt.scale == "e8m0"
            and accelerator_operand_dtype(recipe) == jnp.bfloat16)


def _accelerator_form(a, b, dims: Dims, recipe: GemmRecipe, k_lhs, k_rhs, k_had, *,
                      form: str, operand_dtypes=None):
    """GPU/TPU forms: MX operands in place (`mxjax.routes.in_place`), others canonical.

    ``operand_dtypes``: the GEMM of the operands cast to them (`gemm`); the in-place
    forms take the casts into their quantize pass.
    """
    if _in_place_mx(recipe):
        signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
        out = in_place.mx_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs, form=form,
                                  operand_dtypes=operand_dtypes)
        (ca, cb), (ba, bb) = dims
        nb = len(ba)
        return out.reshape(out.shape[:nb] + (
            math.prod(a.shape[i] for i in free_axes(a.ndim, ba, ca)),
            math.prod(b.shape[i] for i in free_axes(b.ndim, bb, cb))))
    a3, b3 = _rotate(*canonical_operands(*cast_operands(a, b, operand_dtypes), dims), recipe, k_had)
    return _accelerator_gemm(a3, b3, recipe, k_lhs, k_rhs)


def _free_size(x: jax.Array, batch, contract) -> int:
    return math.prod(x.shape[i] for i in free_axes(x.ndim, batch, contract))


def _cuda_f8_form(a, b, dims: Dims, recipe: GemmRecipe, k_lhs, k_rhs, k_had, *,
                  operand_dtypes=None, swap: bool = False):
    """CUDA form of FP8 recipes: f8 operands on FP8 tensor cores (`mxjax.routes.fp8_units`).

    Per-tensor FP8 operands are quantized in place (their scale is the whole tensor's,
    whatever the layout) unless the recipe rotates or draws uniforms, which follow
    the canonical layout; MXFP8 operands always take the canonical layout
    (``jax.nn.scaled_matmul``'s). ``swap`` (the wgrad): the in-place GEMM is computed as
    ``dot_general(b, a)`` and transposed back, the same products and factors (applied in
    the same order), so that XLA writes the f32 result in the layout of the weight it is
    the gradient of and fuses the factors into the GEMM (as ``dot_general(a, b)`` the
    FP8 GEMM's result comes out transposed, and scaling it is a kernel of its own).
    Returns f32 ``[batch..., Fa, Fb]``.
    """
    a, b = cast_operands(a, b, operand_dtypes)
    (ca, cb), (ba, bb) = dims
    if fp8_units.takes_block_scaled(recipe):
        a3, b3 = _rotate(*canonical_operands(a, b, dims), recipe, k_had)
        return fp8_units.block_scaled_dot(a3, b3, recipe, k_lhs, k_rhs)
    if recipe.hadamard is None and not recipe.needs_key:
        aq, a_factors = fp8_units.f8_operand(a, recipe.lhs, None)
        bq, b_factors = fp8_units.f8_operand(b, recipe.rhs, None)
        fa, fb = _free_size(a, ba, ca), _free_size(b, bb, cb)
        if not swap:
            out = fp8_units.f8_dot(aq, bq, dims.as_lax(), a_factors, b_factors)
            return out.reshape(out.shape[:len(ba)] + (fa, fb))
        # dot(b, a), transposed back (the factors in the same order as above).
        out = fp8_units.f8_dot(bq, aq, ((cb, ca), (bb, ba)), a_factors, b_factors)
        out = out.reshape(out.shape[:len(ba)] + (fb, fa))
        return jnp.swapaxes(out, -1, -2)
    a3, b3 = _rotate(*canonical_operands(a, b, dims), recipe, k_had)
    aq, a_factors = fp8_units.f8_operand(a3, recipe.lhs, k_lhs)
    bq, b_factors = fp8_units.f8_operand(b3, recipe.rhs, k_rhs)
    return fp8_units.f8_dot(aq, bq, canonical_dimension_numbers(a3.ndim - 2),
                                  a_factors, b_factors)


def takes_f8_on_cuda(recipe: GemmRecipe) -> bool:
    """Whether the GEMM's CUDA form runs on FP8 tensor cores (per-tensor FP8 or MXFP8)."""
    return fp8_units.takes_f8_operands(recipe) or fp8_units.takes_block_scaled(recipe)


# Jitted (inlined into the caller's jaxpr) so that JAX caches its trace per operand
# types and static arguments: all three platform forms are traced (lowering keeps one),
# and a program with many GEMMs of the same shapes (a model's layers, a GEMM and its
# rematerialization, a test suite) would otherwise trace them again at every call. Its
# ops carry the scope 'jit(emulated_gemm)' below the caller's.
@functools.partial(jax.jit, inline=True,
                   static_argnames=("dims", "recipe", "gemm_name", "operand_dtypes", "out_dtype"))
def emulated_gemm(a: jax.Array, b: jax.Array, dims: Dims, recipe: GemmRecipe, key,
                  gemm_name: str, operand_dtypes=None, out_dtype=None) -> jax.Array:
    """The XLA reference backend.

    The program depends on the platform it is lowered for (not on the tracing
    machine): XLA:CPU gets canonical operands and `_cpu_gemm`, GPUs and TPUs
    `_accelerator_form` (docs/NUMERICS.md, "Emulated GEMM"), except that CUDA gets
    f8 operands on FP8 tensor cores for per-tensor FP8 and MXFP8 recipes
    (`_cuda_f8_form`, `mxjax.routes.fp8_units`).

    Args:
      a, b: the GEMM's operands (any float dtype) and its dimension numbers.
      recipe: the GEMM's recipe.
      key: the GEMM's key (None when the recipe needs none); split into (lhs
        rounding, rhs rounding, Hadamard signs).
      gemm_name: 'fprop', 'dgrad' or 'wgrad' (for backends' error messages).
      operand_dtypes: the GEMM is that of the operands cast to these (`gemm`), or None.
      out_dtype: the f32 result is cast to it (None: f32).
    Returns:
      [batch..., Fa, Fb] (free axes flattened, as `canonical_operands`), f32 or out_dtype.
    """
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    form = functools.partial(_accelerator_form, dims=dims, recipe=recipe, k_lhs=k_lhs,
                             k_rhs=k_rhs, k_had=k_had, operand_dtypes=operand_dtypes)

    def cpu(a, b):
        return _canonical_cpu_form(*cast_operands(a, b, operand_dtypes), dims, recipe, k_lhs, k_rhs,
                                   k_had)

    gpu = functools.partial(form, form="gpu")
    if takes_f8_on_cuda(recipe):
        cuda = functools.partial(_cuda_f8_form, dims=dims, recipe=recipe, k_lhs=k_lhs,
                                 k_rhs=k_rhs, k_had=k_had, operand_dtypes=operand_dtypes,
                                 swap=gemm_name == "wgrad")
        gpu = functools.partial(cuda_or_other, cuda=cuda, other=gpu)
    out = per_platform(
        a, b,
        cpu=cpu,
        gpu=gpu,
        tpu=functools.partial(form, form="tpu"))
    return out if out_dtype is None else out.astype(out_dtype)


def _mx_route_gemm(a: jax.Array, b: jax.Array, *, route, dims: Dims, recipe: GemmRecipe, key,
                   operand_dtypes=None, out_dtype=None) -> jax.Array:
    """The 'xla_fp8' and 'xla_fp4' backends: ``route`` is `mxjax.routes.xla_fp8.mx_gemm_fp8`
    (MXFP4 operands carried exactly in FP8 on XLA's FP8 GEMM) or
    `mxjax.routes.xla_fp4.mx_gemm_fp4` (written as NVFP4 for XLA's block-scaled dot), each
    the emulation's result where the operands cannot be carried. [batch..., Fa, Fb], f32
    or out_dtype (cast inside the route's branches, so that XLA can fuse the cast into
    the GEMM)."""
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
    out = route(a, b, dims, recipe, k_lhs, k_rhs, signs, operand_dtypes=operand_dtypes,
                out_dtype=out_dtype)
    (ca, cb), (ba, bb) = dims
    return out.reshape(tuple(a.shape[i] for i in ba)
                       + (_free_size(a, ba, ca), _free_size(b, bb, cb)))


# The MXFP4 routes by backend name.
_MX_ROUTES = {"xla_fp8": xla_fp8.mx_gemm_fp8,
              "xla_fp4": xla_fp4.mx_gemm_fp4}


def _kernel_gemm(a: jax.Array, b: jax.Array, dims: Dims, recipe: GemmRecipe, key,
                 gemm_name: str, operand_dtypes=None, out_dtype=None) -> jax.Array:
    """Every backend but 'xla': the MXFP4 routes 'xla_fp8' and 'xla_fp4' (in-place operands
    in exact FP8 / NVFP4 carriers), and the kernels ('pallas', 'pallas_fp8', 'triton':
    packed operands + mx_dot), 'auto' resolving to one of them or to 'xla'.

    Same operands, keys and rotation as `emulated_gemm`; the quantized operands are
    packed (`quantize`) and contracted by `mxjax.kernels.mx_dot`. The backend is resolved
    per lowering platform for the chip compiled for (`kernels.backends_per_platform`):
    'auto' takes that chip's choice (`kernels.AUTO_CHOICES`); an explicit kernel backend
    that cannot run on it raises when the program is lowered for it, and one that does
    not implement the recipe's formats raises at once.
    """
    from mxjax import kernels  # imported here: keeps `import mxjax` free of Pallas

    choices = kernels.backends_per_platform(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt,
                                            where=gemm_name)

    def emulated(a, b):
        return emulated_gemm(a, b, dims, recipe, key, gemm_name, operand_dtypes, out_dtype)

    if all(backend == "xla" for backend, _ in choices.values()):
        return emulated(a, b)

    def kernel(a, b, backend, platform):
        a, b = cast_operands(a, b, operand_dtypes)
        a3, b3, k_lhs, k_rhs = quantizer_operands(*canonical_operands(a, b, dims), recipe, key)

        def q(x, op, k):
            return quantize_with(x, op, -1, key=k)

        out = kernels.mx_dot(q(a3, recipe.lhs, k_lhs), q(b3, recipe.rhs, k_rhs),
                             backend=backend, platform=platform)
        return out if out_dtype is None else out.astype(out_dtype)

    out = jax.eval_shape(emulated, a, b)

    def branch(platform):
        backend, why = choices[platform]
        if why:
            return lambda a, b: kernels.unavailable(why, out.shape, out.dtype, a, b)
        if backend == "xla":
            return emulated
        if backend in _MX_ROUTES:
            route = _MX_ROUTES[backend]
            if backend == "xla_fp4" and platform == "gpu":
                # The one-pass operand kernel (mxjax.routes.xla_fp4_kernel). 'xla_fp8' keeps
                # XLA's two passes: on an H200 its one-pass Pallas kernel
                # (mxjax.kernels.fp8_operand) ran 3x (row) to 10x (column) slower.
                from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt  # Pallas: on first use

                cc = kernels.target_chip("gpu").compute_capability
                route = functools.partial(route, kernel=True, e2m1_cvt=has_e2m1_cvt(cc))
            return functools.partial(_mx_route_gemm, route=route, dims=dims,
                                     recipe=recipe, key=key, operand_dtypes=operand_dtypes,
                                     out_dtype=out_dtype)
        return functools.partial(kernel, backend=backend, platform=platform)

    return per_platform(a, b, cpu=branch("cpu"), gpu=branch("gpu"), tpu=branch("tpu"))


# Backend name (mxjax.recipes.BACKENDS) -> function(a, b, dims, recipe, key, gemm_name,
# operand_dtypes, out_dtype) -> [batch..., Fa, Fb] (f32, or out_dtype when given). Every
# name but 'xla' runs through mxjax.kernels' dispatch.
_BACKEND_FNS: dict[str, Callable[..., jax.Array]] = {
    "xla": emulated_gemm,
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


def has_explicit_axes(*xs: jax.Array) -> bool:
    """Whether any of the arrays' types carries a mesh with explicit axes (``jax.set_mesh``
    of a mesh made with ``AxisType.Explicit``, ``jax.make_mesh``'s default in jax 0.12)."""
    return any(jax.typeof(x).sharding.mesh.explicit_axes for x in xs)


def _abstract(x: jax.Array, sharded: bool, dtype=None) -> jax.ShapeDtypeStruct:
    sharding = jax.typeof(x).sharding if sharded else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype,
                                sharding=sharding)


def gemm(a: jax.Array, b: jax.Array, dims: Dims, recipe: GemmRecipe, key, *,
         precision=None, preferred_element_type=None, gemm_name: str = "gemm",
         out_sharding=None, operand_dtypes=None) -> jax.Array:
    """One GEMM ``dot_general(a, b, dims)`` under `recipe` (no custom gradient).

    ``operand_dtypes``: None or a pair (for a, for b) of dtypes or None; the GEMM
    is then that of ``a.astype(operand_dtypes[0])`` and ``b.astype(operand_dtypes[1])``
    (None: not cast), bit for bit, result dtype included. The emulation takes the
    casts into its quantize pass where it can (the TPU kernel reads an f32 operand
    and rounds it to bf16 itself) instead of materializing a cast copy.

    Pass-through recipes call ``lax.dot_general(a, b, dims, precision,
    preferred_element_type, out_sharding=...)`` unchanged. Otherwise the result
    is computed in f32 (see the module docstring) and cast to ``lax.dot_general``'s
    result dtype. Sharding follows ``lax.dot_general``: under a mesh with explicit
    axes the result gets the sharding ``lax.dot_general(a, b, dims,
    out_sharding=out_sharding)`` would give it (and the same error where that
    is ambiguous: sharded contracting dims without ``out_sharding``), and the
    emulation inside runs with those axes made auto (``jax.sharding.auto_axes``:
    the partitioner places its reshapes, block reductions and collectives).
    Otherwise, given ``out_sharding``, the result is resharded to it with
    ``jax.sharding.reshard``.
    """
    if recipe.is_passthrough:
        a, b = cast_operands(a, b, operand_dtypes)
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return lax.dot_general(a, b, dims.as_lax(), precision=precision,
                               preferred_element_type=preferred_element_type, **extra)
    explicit = has_explicit_axes(a, b)
    extra = {"out_sharding": out_sharding} if explicit and out_sharding is not None else {}
    out_type = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims.as_lax(),
                          preferred_element_type=preferred_element_type, **extra),
        *(_abstract(x, explicit, d) for x, d in zip((a, b), operand_dtypes or (None, None))))

    def emulated(a, b, key):
        (ca, cb), (ba, bb) = dims
        out = _backend_fn(recipe)(a, b, dims, recipe, key if recipe.needs_key else None,
                                  gemm_name, operand_dtypes, out_type.dtype)
        fa = [a.shape[i] for i in free_axes(a.ndim, ba, ca)]
        fb = [b.shape[i] for i in free_axes(b.ndim, bb, cb)]
        out = out.reshape(tuple(a.shape[i] for i in ba) + tuple(fa) + tuple(fb))
        return out.astype(out_type.dtype)

    if explicit:
        return jax.sharding.auto_axes(emulated, out_sharding=out_type.sharding)(a, b, key)
    out = emulated(a, b, key)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out
