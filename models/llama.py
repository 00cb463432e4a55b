"""Llama 3.x in Flax NNX, with a precision policy on every linear layer.

Architecture (Llama 3.1): token embedding, ``n_layers`` pre-norm decoder blocks
(RMSNorm -> grouped-query causal self-attention with llama3-scaled RoPE ->
residual, RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an untied (or
tied) LM head. No biases anywhere.

Numerics:
* parameters are stored in ``config.param_dtype`` (fp32 by default) and cast to
  the compute dtype ``config.dtype`` (fp32 or bf16) where they are used;
* RoPE frequencies (with the llama3 frequency scaling), cos/sin tables and the
  rotation itself run in fp32; RMSNorm statistics run in fp32; attention
  scores and the softmax run in fp32; logits are returned in fp32.

RoPE uses the half-split ("rotate_half") convention of Hugging Face
``transformers``: dimension ``i`` is paired with ``i + head_dim // 2``. Hugging
Face Llama checkpoints therefore load without permuting q/k rows.

Layer parameters are stored stacked along a leading ``layers`` axis (created
with ``nnx.vmap``) whether or not the forward scans, so checkpoints, the HF
importer and the sharding rules see one layout. ``scan_layers=True`` runs the
blocks with ``nnx.scan`` (one compiled block); ``False`` unrolls a Python loop
over slices of the same stacked parameters.

Precision policies: the seven projections (q, k, v, o, gate, up, down) compute
``policy.dot_general(key=k)(x, kernel, dimension_numbers, operand_dtype=x.dtype)``
(other policy objects get ``kernel.astype(x.dtype)`` instead) with
``k = fold_in(fold_in(policy_key, layer), projection)`` (see
:data:`PROJECTION_INDEX`), so every layer and projection draws its own noise,
also under scan (the layer index is scanned alongside the parameters). Pass a
per-step key (e.g. ``fold_in(base_key, step)``) for per-step noise. The
embedding, LM head and the attention score/value products stay at the compute
precision unless ``quantize_embed_head`` / ``quantize_attention`` is set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import attention
from models import sharding as shd
from mxjax.policies import PrecisionPolicy
from mxjax.remat import REMAT_POLICIES, remat_policy

__all__ = [
    "PROJECTION_INDEX",
    "DecoderLayer",
    "Embedding",
    "Linear",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RopeScaling",
    "apply_rope",
    "param_count",
    "rope_cos_sin",
    "rope_inv_freq",
]

# Index folded into the per-layer key for each GEMM of a decoder layer.
PROJECTION_INDEX: dict[str, int] = {
    "q_proj": 0,
    "k_proj": 1,
    "v_proj": 2,
    "o_proj": 3,
    "gate_proj": 4,
    "up_proj": 5,
    "down_proj": 6,
    "attn_scores": 7,  # only with quantize_attention
    "attn_values": 8,  # only with quantize_attention
}
# The embedding and LM head use the "layer" indices n_layers and n_layers + 1.
_EMBED_INDEX = 0
_HEAD_INDEX = 0

_ALLOWED_DTYPES = ("float32", "bfloat16", "float16")
_ATTENTION_IMPLS = ("explicit", "jax", "fused")

DotGeneral = Callable[..., jax.Array]


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """llama3 RoPE frequency scaling (Llama 3.1 values by default)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "RopeScaling needs high_freq_factor > low_freq_factor > 0, got "
                f"low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "RopeScaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


def _canon_dtype(name: str, value: Any) -> np.dtype:
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError as e:
        raise ValueError(f"LlamaConfig.{name}: not a dtype: {value!r}") from e
    if dt.name not in _ALLOWED_DTYPES:
        raise ValueError(f"LlamaConfig.{name} must be one of {_ALLOWED_DTYPES}, got {dt.name}")
    return dt


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Llama 3.x hyper-parameters (frozen, hashable).

    ``dtype`` is the compute dtype and ``param_dtype`` the storage dtype; both
    accept a string or a numpy/jax dtype and are normalised to ``np.dtype``.
    ``head_dim`` defaults to ``dim // n_heads``. ``remat`` recomputes each
    decoder block in the backward pass (``jax.checkpoint``) under ``remat_policy``
    (`mxjax.remat.remat_policy`): ``"full"`` saves nothing, ``"quantized_residuals"``
    keeps the packed residuals of the quantized GEMMs (`mxjax.residuals`).
    ``attention_impl`` (causal grouped-query attention):

    * ``"explicit"`` (the default): einsum-style dot_generals with fp32 scores and
      softmax; it materializes the T x S scores (at seq 8192 the Llama 3.1-8B layer's
      train step needs 21.6 GB of temporaries on an H200). The only form that
      supports ``quantize_attention`` (the policy sees its two GEMMs).
    * ``"jax"``: ``jax.nn.dot_product_attention(implementation=None)``, which in jax
      0.12 is XLA's (unfused) attention on every platform, GPUs included.
    * ``"fused"``: the fused kernel of the platform the program is lowered for
      (``models.attention``): cuDNN flash attention on NVIDIA GPUs (``cuda``; needs
      a bfloat16/float16 ``dtype``, else lowering for cuda raises), Pallas splash
      attention on TPUs, the explicit form on CPU (bit-identical to ``"explicit"``
      there); lowering for any other platform raises. Not combinable with
      ``quantize_attention``.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    init_std: float = 0.02
    scan_layers: bool = True
    remat: bool = False
    remat_policy: str = "full"
    attention_impl: str = "explicit"
    quantize_embed_head: bool = False
    quantize_attention: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                     "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"LlamaConfig.dim ({self.dim}) is not divisible by n_heads ({self.n_heads});"
                    " set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.head_dim must be a positive even int, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                "LlamaConfig.rope_scaling must be a RopeScaling or None, got "
                f"{type(self.rope_scaling).__name__}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"LlamaConfig.norm_eps must be > 0, got {self.norm_eps}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"LlamaConfig.remat_policy must be one of {REMAT_POLICIES}, "
                             f"got {self.remat_policy!r}")
        if self.attention_impl not in _ATTENTION_IMPLS:
            raise ValueError(
                f"LlamaConfig.attention_impl must be one of {_ATTENTION_IMPLS}, "
                f"got {self.attention_impl!r}"
            )
        if self.quantize_attention and self.attention_impl != "explicit":
            raise ValueError(
                "LlamaConfig.quantize_attention needs attention_impl='explicit' "
                f"(got {self.attention_impl!r}: its attention GEMMs run inside a kernel "
                "that no precision policy reaches)"
            )
        object.__setattr__(self, "dtype", _canon_dtype("dtype", self.dtype))
        object.__setattr__(self, "param_dtype", _canon_dtype("param_dtype", self.param_dtype))

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def llama3_8b(cls, **overrides) -> LlamaConfig:
        """Llama 3.1-8B exactly (8,030,261,248 parameters)."""
        kw = {
            "vocab_size": 128256, "dim": 4096, "n_layers": 32, "n_heads": 32,
            "n_kv_heads": 8, "ffn_dim": 14336, "max_seq_len": 8192, "rope_theta": 500000.0,
            "rope_scaling": RopeScaling(), "norm_eps": 1e-5, "tie_embeddings": False,
        }
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def llama3_1b(cls, **overrides) -> LlamaConfig:
        """Llama 3.2-1B architecture (1,235,814,400 parameters; tied embeddings,
        llama3 RoPE scaling with factor 32). For GPU runs."""
        kw = {
            "vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32,
            "n_kv_heads": 8, "ffn_dim": 8192, "head_dim": 64, "max_seq_len": 8192,
            "rope_theta": 500000.0, "rope_scaling": RopeScaling(factor=32.0),
            "norm_eps": 1e-5, "tie_embeddings": True,
        }
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def tiny(cls, vocab_size: int = 512, **overrides) -> LlamaConfig:
        """CPU-sized Llama (d 256, 4 layers, 8 heads / 2 KV heads, FFN 896)."""
        kw = {
            "vocab_size": vocab_size, "dim": 256, "n_layers": 4, "n_heads": 8,
            "n_kv_heads": 2, "ffn_dim": 896, "max_seq_len": 2048, "rope_theta": 500000.0,
            "rope_scaling": RopeScaling(), "norm_eps": 1e-5, "tie_embeddings": False,
        }
        kw.update(overrides)
        return cls(**kw)

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies f32[head_dim // 2] with llama3 scaling, computed in fp32.

    ``inv_freq[i] = theta ** (-2i / head_dim)``; with scaling, wavelengths longer
    than ``original / low_freq_factor`` are divided by ``factor``, shorter than
    ``original / high_freq_factor`` kept, and the band between interpolated.
    """
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / jnp.float32(head_dim)
    inv_freq = 1.0 / (jnp.float32(theta) ** exponent)
    if scaling is None:
        return inv_freq
    factor = jnp.float32(scaling.factor)
    low = jnp.float32(scaling.low_freq_factor)
    high = jnp.float32(scaling.high_freq_factor)
    old_len = jnp.float32(scaling.original_max_position_embeddings)
    wavelen = 2.0 * jnp.float32(math.pi) / inv_freq
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled).astype(jnp.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[..., head_dim // 2] for integer ``positions`` [...]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [B, T, H, D] by cos/sin [T, D/2] in fp32 (half-split layout).

    Pairs ``(x[i], x[i + D/2])``: ``out = x * cat(cos, cos) + rotate_half(x) *
    cat(sin, sin)`` with ``rotate_half(x) = cat(-x2, x1)``. Returns x's dtype.
    """
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


# --------------------------------------------------------------------------- layers


def _check_policy(policy, policy_key) -> None:
    if policy is None:
        return
    if not callable(getattr(policy, "dot_general", None)):
        raise TypeError(
            "Llama(policy=...) must be a precision policy with a .dot_general(key=None) "
            f"method, got {type(policy).__name__}"
        )
    if bool(getattr(policy, "needs_key", False)) and policy_key is None:
        name = getattr(policy, "name", None) or type(policy).__name__
        raise ValueError(
            f"policy {name!r} needs randomness (stochastic rounding or randomized Hadamard): "
            "pass policy_key= (a PRNG key, folded with the training step for per-step noise)"
        )


class _Gemms:
    """Hands out the dot_general for each GEMM of one layer (or of embed/head)."""

    def __init__(self, policy, policy_key, layer_index):
        self.policy = policy
        self.key = policy_key
        self.layer_index = layer_index

    def high(self) -> DotGeneral:
        return jax.lax.dot_general

    def get(self, projection: int) -> DotGeneral:
        if self.policy is None:
            return jax.lax.dot_general
        if self.key is None:
            return self.policy.dot_general(key=None)
        k = jax.random.fold_in(jax.random.fold_in(self.key, self.layer_index), projection)
        return self.policy.dot_general(key=k)

    def project(self, projection: int, x: jax.Array, kernel: jax.Array, dn) -> jax.Array:
        """``x @ kernel.astype(x.dtype)`` through the projection's dot_general.

        An mxjax policy gets the kernel as stored with ``operand_dtype=x.dtype``
        (the same values and gradients; its quantizers read e.g. an f32 master
        weight directly instead of a bf16 copy); anything else the cast kernel.
        """
        if isinstance(self.policy, PrecisionPolicy) and kernel.dtype != x.dtype:
            return self.get(projection)(x, kernel, dn, operand_dtype=x.dtype)
        return self.get(projection)(x, kernel.astype(x.dtype), dn)


class RMSNorm(nnx.Module):
    """RMSNorm with fp32 statistics: ``scale * x / sqrt(mean(x^2) + eps)``.

    ``scale``: param_dtype[dim], logical axes ``('norm',)``.
    """

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: jax.Array, dtype) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        y = xf * jax.lax.rsqrt(var + jnp.float32(self.eps))
        return (self.scale[...].astype(jnp.float32) * y).astype(dtype)


class Linear(nnx.Module):
    """Bias-free projection ``y = x @ kernel`` through a supplied dot_general.

    ``kernel``: param_dtype[in, out] with logical axes ``axes``. Input
    [..., in] in the compute dtype, output [..., out] in the compute dtype.
    """

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str, str], index: int,
                 init_std: float, param_dtype, rngs: nnx.Rngs):
        self.index = index
        init = jax.nn.initializers.normal(stddev=init_std)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype),
                                logical_axes=axes)

    def __call__(self, x: jax.Array, gemms: _Gemms) -> jax.Array:
        dn = (((x.ndim - 1,), (0,)), ((), ()))
        return gemms.project(self.index, x, self.kernel[...], dn)


class Embedding(nnx.Module):
    """Token embedding table ``embedding``: param_dtype[vocab, dim], axes (vocab, embed)."""

    def __init__(self, vocab_size: int, dim: int, *, init_std: float, param_dtype,
                 rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(stddev=init_std)
        self.embedding = nnx.Param(init(rngs.params(), (vocab_size, dim), param_dtype),
                                   logical_axes=("vocab", "embed"))


def _attention_explicit(q, k, v, *, n_kv_heads, gemms: _Gemms, quantize: bool):
    """Causal GQA attention. q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] (q's dtype).

    Query head ``h`` attends with KV head ``h // (H // KV)`` (HF ``repeat_kv``).
    Scores and softmax in fp32.
    """
    b, t, h, d = q.shape
    s = k.shape[1]
    g = h // n_kv_heads
    dtype = q.dtype
    qg = q.reshape(b, t, n_kv_heads, g, d).transpose(0, 2, 3, 1, 4)  # B,KV,G,T,D
    kt = k.transpose(0, 2, 1, 3)  # B,KV,S,D
    vt = v.transpose(0, 2, 1, 3)  # B,KV,S,D
    dg_s = gemms.get(PROJECTION_INDEX["attn_scores"]) if quantize else gemms.high()
    dg_v = gemms.get(PROJECTION_INDEX["attn_values"]) if quantize else gemms.high()
    scores = dg_s(qg, kt, (((4,), (3,)), ((0, 1), (0, 1))),
                  preferred_element_type=jnp.float32)  # B,KV,G,T,S
    scores = scores.astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(d))
    causal = jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = dg_v(probs, vt, (((4,), (2,)), ((0, 1), (0, 1))),
               preferred_element_type=jnp.float32)  # B,KV,G,T,D
    return out.astype(dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


class DecoderLayer(nnx.Module):
    """One Llama block: x + Attn(RMSNorm(x)), then h + MLP(RMSNorm(h)).

    Call: ``(x [B,T,dim] compute dtype, layer_index int, cos/sin f32[T, head_dim/2],
    policy, policy_key) -> [B,T,dim]``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        kw = {"init_std": c.init_std, "param_dtype": c.param_dtype, "rngs": rngs}
        hd = c.head_dim
        self.input_layernorm = RMSNorm(c.dim, eps=c.norm_eps, param_dtype=c.param_dtype)
        self.q_proj = Linear(c.dim, c.n_heads * hd, axes=("embed", "heads"),
                             index=PROJECTION_INDEX["q_proj"], **kw)
        self.k_proj = Linear(c.dim, c.n_kv_heads * hd, axes=("embed", "kv_heads"),
                             index=PROJECTION_INDEX["k_proj"], **kw)
        self.v_proj = Linear(c.dim, c.n_kv_heads * hd, axes=("embed", "kv_heads"),
                             index=PROJECTION_INDEX["v_proj"], **kw)
        self.o_proj = Linear(c.n_heads * hd, c.dim, axes=("heads", "embed"),
                             index=PROJECTION_INDEX["o_proj"], **kw)
        self.post_attention_layernorm = RMSNorm(c.dim, eps=c.norm_eps,
                                                param_dtype=c.param_dtype)
        self.gate_proj = Linear(c.dim, c.ffn_dim, axes=("embed", "mlp"),
                                index=PROJECTION_INDEX["gate_proj"], **kw)
        self.up_proj = Linear(c.dim, c.ffn_dim, axes=("embed", "mlp"),
                              index=PROJECTION_INDEX["up_proj"], **kw)
        self.down_proj = Linear(c.ffn_dim, c.dim, axes=("mlp", "embed"),
                                index=PROJECTION_INDEX["down_proj"], **kw)

    def __call__(self, x, layer_index, cos, sin, *, policy=None, policy_key=None):
        c = self.config
        gemms = _Gemms(policy, policy_key, layer_index)
        b, t, _ = x.shape
        dtype = c.dtype
        h = self.input_layernorm(x, dtype)
        q = shd.constrain(self.q_proj(h, gemms), ("batch", "seq", "act_heads"))
        k = shd.constrain(self.k_proj(h, gemms), ("batch", "seq", "act_kv_heads"))
        v = shd.constrain(self.v_proj(h, gemms), ("batch", "seq", "act_kv_heads"))
        q = apply_rope(q.reshape(b, t, c.n_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(b, t, c.n_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
        explicit = functools.partial(_attention_explicit, n_kv_heads=c.n_kv_heads,
                                     gemms=gemms, quantize=c.quantize_attention)
        if c.attention_impl == "jax":
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        elif c.attention_impl == "fused":
            a = attention.fused_attention(q, k, v, cpu=explicit)
        else:
            a = explicit(q, k, v)
        a = shd.constrain(a.reshape(b, t, c.n_heads * c.head_dim),
                          ("batch", "seq", "act_heads"))
        x = x + self.o_proj(a, gemms).astype(x.dtype)
        x = shd.constrain(x, ("batch", "seq", "act_embed"))
        h = self.post_attention_layernorm(x, dtype)
        gate = self.gate_proj(h, gemms)
        up = self.up_proj(h, gemms)
        m = shd.constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        x = x + self.down_proj(m, gemms).astype(x.dtype)
        return shd.constrain(x, ("batch", "seq", "act_embed"))


def _stack_axes(module: nnx.Module) -> None:
    """Prefix the logical axes of every param of a vmapped stack with 'layers'."""
    for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError("every Llama parameter must carry logical_axes metadata")
        var.set_metadata("logical_axes", ("layers",) + tuple(axes))


# --------------------------------------------------------------------------- model


def _check_token_ids(tokens, vocab_size: int) -> None:
    """ValueError for concrete token ids outside [0, vocab_size); traced ids pass (see
    `Llama.embed` for what they give)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if ids.size == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"tokens: id {int(ids[pos])} at position {pos} is outside the "
                         f"vocabulary [0, {vocab_size}) ({int(bad.sum())} such ids; min "
                         f"{int(ids.min())}, max {int(ids.max())})")


class Llama(nnx.Module):
    """Llama 3.x causal LM.

    ``Llama(config, rngs=nnx.Rngs(0))``; ``model(tokens int32[B, T], *, policy=None,
    policy_key=None) -> logits f32[B, T, vocab_size]``.

    Parameters (names follow HF, layer params stacked along axis 0):
    ``embed_tokens.embedding [V, D]``, ``layers.<sub>.kernel [L, in, out]``,
    ``layers.*_layernorm.scale [L, D]``, ``norm.scale [D]``,
    ``lm_head.kernel [D, V]`` (absent with ``tie_embeddings``).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama(config=...) must be a LlamaConfig, got {type(config).__name__}")
        c = config
        self.config = c
        self.embed_tokens = Embedding(c.vocab_size, c.dim, init_std=c.init_std,
                                      param_dtype=c.param_dtype, rngs=rngs)

        @nnx.split_rngs(splits=c.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(r: nnx.Rngs):
            return DecoderLayer(c, rngs=r)

        self.layers = make_layers(rngs)
        _stack_axes(self.layers)
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, param_dtype=c.param_dtype)
        if not c.tie_embeddings:
            self.lm_head = Linear(c.dim, c.vocab_size, axes=("embed", "vocab"),
                                  index=_HEAD_INDEX, init_std=c.init_std,
                                  param_dtype=c.param_dtype, rngs=rngs)

    # -- pieces (public so parity tests can compare layer by layer) -----------------------

    def embed(self, tokens: jax.Array, *, policy=None, policy_key=None) -> jax.Array:
        """Token embedding: int32[B, T] -> compute dtype [B, T, dim].

        Token ids must lie in ``[0, vocab_size)``. Concrete ids outside it raise
        ValueError; under ``jit`` (traced ids, which cannot be checked without
        checkify) such a token's embedding row is NaN; through attention it makes
        its whole sequence's logits NaN, so the loss is NaN and the training loop's
        non-finite guard skips the step. Never another row (``jnp.take`` would wrap
        negative ids) nor a silent zero row (the one-hot path).
        """
        c = self.config
        _check_token_ids(tokens, c.vocab_size)
        table = self.embed_tokens.embedding[...]
        if c.quantize_embed_head and policy is not None:
            # Embedding as a one-hot GEMM so the policy sees it (costs a V x D GEMM).
            gemms = _Gemms(policy, policy_key, c.n_layers)
            onehot = jax.nn.one_hot(tokens, c.vocab_size, dtype=c.dtype)
            h = gemms.get(_EMBED_INDEX)(onehot, table.astype(c.dtype),
                                        (((2,), (0,)), ((), ())))
        else:
            h = jnp.take(table, tokens, axis=0, mode="clip").astype(c.dtype)
        valid = (tokens >= 0) & (tokens < c.vocab_size)
        h = jnp.where(valid[..., None], h, jnp.asarray(jnp.nan, h.dtype))
        return shd.constrain(h, ("batch", "seq", "act_embed"))

    def rope(self, seq_len: int) -> tuple[jax.Array, jax.Array]:
        """cos, sin f32[seq_len, head_dim // 2] for positions 0..seq_len-1."""
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        return rope_cos_sin(jnp.arange(seq_len, dtype=jnp.int32), inv_freq)

    def layer(self, index: int) -> DecoderLayer:
        """Decoder layer ``index`` as a standalone module (a slice of the stack)."""
        if not 0 <= index < self.config.n_layers:
            raise IndexError(f"layer index {index} out of range [0, {self.config.n_layers})")
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))

    def head(self, h: jax.Array, *, policy=None, policy_key=None) -> jax.Array:
        """Final RMSNorm + LM head: [B, T, dim] -> logits f32[B, T, vocab]."""
        c = self.config
        h = self.norm(h, c.dtype)
        gemms = _Gemms(policy, policy_key, c.n_layers + 1)
        dg = gemms.get(_HEAD_INDEX) if (c.quantize_embed_head and policy is not None) \
            else gemms.high()
        if c.tie_embeddings:
            w = self.embed_tokens.embedding[...].astype(c.dtype)
            dn = (((2,), (1,)), ((), ()))
        else:
            w = self.lm_head.kernel[...].astype(c.dtype)
            dn = (((2,), (0,)), ((), ()))
        logits = dg(h, w, dn, preferred_element_type=jnp.float32).astype(jnp.float32)
        return shd.constrain(logits, ("batch", "seq", "act_vocab"))

    def run_layers(self, h: jax.Array, cos, sin, *, policy=None, policy_key=None) -> jax.Array:
        """All decoder layers: [B, T, dim] -> [B, T, dim] (scanned or unrolled)."""
        c = self.config

        def block(layer: DecoderLayer, x, idx):
            return layer(x, idx, cos, sin, policy=policy, policy_key=policy_key)

        if c.remat:
            block = nnx.remat(block, policy=remat_policy(c.remat_policy))

        if c.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry)
            def scan_fn(layer, x, idx):
                return block(layer, x, idx)

            return scan_fn(self.layers, h, jnp.arange(c.n_layers, dtype=jnp.int32))
        graphdef, state = nnx.split(self.layers)
        for i in range(c.n_layers):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            h = block(layer, h, jnp.int32(i))
        return h

    def __call__(self, tokens: jax.Array, *, policy=None, policy_key=None) -> jax.Array:
        """tokens int32[B, T] -> logits f32[B, T, vocab_size].

        ``policy``: a precision policy (static, hashable) or None for plain
        ``lax.dot_general``. ``policy_key``: PRNG key, required when
        ``policy.needs_key``; folded per layer and projection inside.
        """
        c = self.config
        _check_policy(policy, policy_key)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be int[B, T], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array, got {tokens.dtype}")
        t = tokens.shape[1]
        if t > c.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds config.max_seq_len={c.max_seq_len}")
        h = self.embed(tokens, policy=policy, policy_key=policy_key)
        cos, sin = self.rope(t)
        h = self.run_layers(h, cos, sin, policy=policy, policy_key=policy_key)
        return self.head(h, policy=policy, policy_key=policy_key)


def param_count(config: LlamaConfig) -> int:
    """Number of parameters of ``Llama(config)``, via ``nnx.eval_shape`` (no allocation)."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))
