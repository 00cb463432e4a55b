"""Fused causal grouped-query attention, chosen per lowering platform.

:func:`fused_attention` is ``attention_impl="fused"`` of :class:`models.llama.LlamaConfig`.
The kernel is picked with ``jax.lax.platform_dependent``, i.e. for the platform the
program is *lowered* for (a deviceless compile for an H200 on a CPU machine gets the
H200's kernel), never from ``jax.devices()`` or ``jax.default_backend()`` at trace time:

========  ==================================================================================
cuda      cuDNN flash attention: ``jax.nn.dot_product_attention(q, k, v, is_causal=True,
          implementation="cudnn")`` with the grouped K/V heads as they are (cuDNN takes
          GQA natively; nothing is repeated). Compiles to the ``__cudnn$fmhaSoftmax`` and
          ``__cudnn$fmhaSoftmaxBackward`` custom calls. bf16/fp16 compute dtypes only.
tpu       Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``,
          Mosaic kernels, static causal mask, GQA through its grouped K/V heads), with
          512x512 blocks. It lowers without a device for v5e.
cpu       The explicit form (``models/llama.py``'s, passed in): the same program as
          ``attention_impl="explicit"``, so CPU runs of a fused config give bit-identical
          losses. XLA:CPU has no fused attention kernel; ``jax.nn``'s XLA attention would
          compute the same einsum-softmax-einsum and materialize the same T x S scores.
other     (``rocm``, ...) no fused kernel here: lowering raises, naming the setting.
========  ==================================================================================

Every branch is traced on every host (that is how ``platform_dependent`` works). Where a
kernel cannot take the inputs (a float32 compute dtype for cuDNN, no cuDNN library on
the tracing host, a shape the kernel rejects), its branch becomes a placeholder that
raises at *lowering* for that platform with the kernel's reason, so the other platforms
still compile and nothing silently falls back to a slower path.

Numerics: every kernel computes softmax(q k^T / sqrt(D)) v with fp32 accumulation and an
fp32 softmax, as the explicit form does, but in its own order (online softmax over
blocks); results agree to rounding, not bit for bit. Splash takes no scale argument: q
is multiplied by 1/sqrt(D) in fp32 and rounded to its dtype first (one extra rounding of
q). Splash pads the sequence to a multiple of its block at the end, which is exact under
the causal mask (a real query never sees a later, padded key; padded queries are cut).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from models import sharding as shd

__all__ = ["FUSED_KERNELS", "SPLASH_BLOCK", "cudnn_attention", "fused_attention",
           "splash_attention"]

# What attention_impl="fused" runs on each lowering platform (printed by docs and benches).
FUSED_KERNELS: dict[str, str] = {
    "cuda": "cuDNN flash attention (__cudnn$fmhaSoftmax / __cudnn$fmhaSoftmaxBackward)",
    "tpu": "Pallas splash attention (Mosaic kernels)",
    "cpu": "the explicit form (einsum scores, fp32 softmax; XLA:CPU has no fused kernel)",
}

# Splash block (query and key/value, forward and backward) for sequences >= 512.
SPLASH_BLOCK = 512
_TPU_LANES = 128

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


# ------------------------------------------------------------------------ kernels


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal GQA cuDNN flash attention. q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D].

    Query head ``h`` attends with KV head ``h // (H // KV)`` (cuDNN's grouping, the same
    as the explicit form's). Needs cuDNN at trace time (``nvidia-cudnn-cu12``) and a
    bf16/fp16 dtype; only lowers for ``cuda``.
    """
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _splash_block(t: int) -> int:
    return SPLASH_BLOCK if t >= SPLASH_BLOCK else -(-t // _TPU_LANES) * _TPU_LANES


def _splash_kernel(t_padded: int, n_heads: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    mask = sm.MultiHeadMask([sm.CausalMask((t_padded, t_padded))] * n_heads)
    blocks = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                           block_q_dkv=block, block_kv_dkv=block,
                           block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Built per trace: the kernel holds its mask tables as arrays of the trace that made
    # them (splash caches the mask processing itself).
    return sk.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     interpret: bool = False) -> jax.Array:
    """Causal GQA Pallas splash attention. q [B,T,H,D], k/v [B,T,KV,D] -> [B,T,H,D].

    Lowers for ``tpu`` (``interpret=True``: Pallas' interpreter, any platform, for
    tests). q is scaled by 1/sqrt(D) in fp32 and rounded to its dtype; the sequence is
    padded at the end to a multiple of the block (exact under the causal mask).

    Inside :func:`models.sharding.use_mesh` the kernel runs under ``jax.shard_map``
    with the activations' sharding (batch over data/fsdp, heads over tensor): XLA cannot
    partition a Mosaic kernel and would otherwise gather its operands on every chip.
    Sharding the heads keeps the grouping (query head h with KV head h // (H // KV)) as
    long as the KV heads divide evenly, which the rules check.
    """
    _, t, _, _ = q.shape
    if k.shape[1] != t:
        raise ValueError(f"splash_attention: self-attention only (q has {t} positions, "
                         f"k {k.shape[1]})")
    local = functools.partial(_splash_local, interpret=interpret)
    active = shd.active_mesh()
    if active is None:
        return local(q, k, v)
    mesh, rules = active
    q_spec = shd.logical_to_pspec(("batch", "seq", "act_heads", None), rules, mesh, q.shape)
    kv_spec = shd.logical_to_pspec(("batch", "seq", "act_kv_heads", None), rules, mesh,
                                   k.shape)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v)


def _splash_local(q, k, v, *, interpret: bool):
    _, t, h, d = q.shape
    block = _splash_block(t)
    tp = -(-t // block) * block
    kernel = _splash_kernel(tp, h, block, interpret)
    qs = (q.astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(d))).astype(q.dtype)

    def heads_first(x):  # [B,T,N,D] -> [B,N,Tp,D]
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, 0))) if tp != t else x

    out = jax.vmap(kernel)(heads_first(qs), heads_first(k), heads_first(v))
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(q.dtype)


# ----------------------------------------------------- placeholder failing at lowering


def _shapes(*xs) -> tuple:
    return tuple((tuple(x.shape), np.dtype(x.dtype)) for x in xs)


def _unavailable_abstract(*_, message, out_shapes):
    del message
    return [jax.core.ShapedArray(s, d) for s, d in out_shapes]


def _unavailable_lowering(ctx, *_, message, out_shapes):
    del ctx, out_shapes
    raise ValueError(message)


def _unavailable_batching(args, dims, *, message, out_shapes):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not batching.not_mapped)
    args = [batching.moveaxis(a, d, 0) if d is not batching.not_mapped else
            jnp.broadcast_to(a, (size, *a.shape)) for a, d in zip(args, dims)]
    outs = _unavailable_p.bind(*args, message=message,
                               out_shapes=tuple(((size, *s), d) for s, d in out_shapes))
    return outs, [0] * len(outs)


# Stands for a kernel on a platform that cannot have it; its lowering raises `message`.
_unavailable_p = Primitive("mxjax_fused_attention_unavailable")
_unavailable_p.multiple_results = True
_unavailable_p.def_abstract_eval(_unavailable_abstract)
mlir.register_lowering(_unavailable_p, _unavailable_lowering)
batching.primitive_batchers[_unavailable_p] = _unavailable_batching


def _unavailable(message: str) -> Attention:
    """An attention of the right shape whose lowering (forward or backward) raises."""

    @jax.custom_vjp
    def attend(q, k, v):
        return _unavailable_p.bind(q, k, v, message=message, out_shapes=_shapes(q))[0]

    def fwd(q, k, v):
        return attend(q, k, v), (q, k, v)

    def bwd(res, g):
        return tuple(_unavailable_p.bind(*res, g, message=message, out_shapes=_shapes(*res)))

    attend.defvjp(fwd, bwd)
    return attend


def _kernel_or_unavailable(platform: str, kernel_name: str, kernel: Attention) -> Attention:
    """`kernel`, or, if tracing it rejects the inputs, an attention that raises at lowering."""

    def attend(q, k, v):
        try:
            jax.eval_shape(kernel, q, k, v)
        except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
            reason = f"{type(e).__name__}: {e}"
            return _unavailable(
                f"LlamaConfig.attention_impl='fused' cannot be compiled for {platform!r}: "
                f"{kernel_name} rejects q {q.dtype}{list(q.shape)}, k {k.dtype}"
                f"{list(k.shape)} ({reason}). {_HINTS.get(platform, '')}")(q, k, v)
        return kernel(q, k, v)

    return attend


_HINTS = {
    "cuda": ("cuDNN needs a bfloat16/float16 compute dtype (LlamaConfig.dtype) and the cuDNN "
             "library where the program is traced (pip install nvidia-cudnn-cu12, or "
             "'mxjax[aot-gpu]' for deviceless compiles). attention_impl='explicit' keeps "
             "the unfused form."),
    "tpu": "attention_impl='explicit' keeps the unfused form.",
}


def _no_fused_kernel(q, k, v):
    return _unavailable(
        "LlamaConfig.attention_impl='fused' has no fused kernel for this platform (it has "
        "cuDNN flash attention for 'cuda', splash attention for 'tpu' and the explicit "
        "form for 'cpu'); use attention_impl='jax' (XLA's attention) or 'explicit'")(q, k, v)


# ------------------------------------------------------------------------ dispatch


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    cpu: Attention) -> jax.Array:
    """Causal GQA attention with the lowering platform's fused kernel (module docstring).

    q [B,T,H,D], k/v [B,T,KV,D] -> [B,T,H,D] in q's dtype. ``cpu``: the attention used
    when lowering for CPU (the model passes its explicit form).
    """
    return jax.lax.platform_dependent(
        q, k, v, cpu=cpu,
        cuda=_kernel_or_unavailable("cuda", "cuDNN flash attention", cudnn_attention),
        tpu=_kernel_or_unavailable("tpu", "splash attention", splash_attention),
        default=_no_fused_kernel)
