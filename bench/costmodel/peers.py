"""Other projects' low-precision GEMMs, run in bench/costmodel/programs.py's programs beside mxjax.

A peer is an object with ``.dot_general(key=None)`` (a callable with ``lax.dot_general``'s
signature) and ``needs_key = False``: what models/llama.py and the matmul program take
as a policy. The models give a peer the kernel cast to the compute dtype (bf16).

* ``flax_fp8``: flax's ``Fp8DirectDotGeneralOp`` (``flax.linen.fp8_ops``): its call,
  ``fp8_scaled_dot_general`` (E4M3 inputs, E5M2 output gradient, f8 x f8 dots), with the
  op's initial scale state (scales 1, amax histories of 1024 zeros) as constants: the
  module's program for one step, without Linen's variable plumbing. Its scales come from
  the amax history (delayed scaling); the history's update (an abs-max reduction per
  operand) is dead code here, since the state is constant, and XLA removes it: a real
  step would keep it.
* ``jax_mxfp8``, ``jax_nvfp4``, ``jax_mxfp4``: ``jax.nn.scaled_dot_general`` with
  ``jax.nn.get_scaled_dot_general_config(mode)`` for the forward operands and the
  gradients.
* ``qwix_fp8``: Qwix (google/qwix) quantized training (``dot_general_qt``, what its
  ``QtProvider`` intercepts with): E4M3 weights and activations, E5M2 gradients, per-channel
  absmax scales, if ``qwix`` is installed (not a dependency; :func:`unavailable_reason`).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp

__all__ = ["PEERS", "Peer", "get", "unavailable_reason"]

PEERS = ("flax_fp8", "jax_mxfp8", "jax_nvfp4", "jax_mxfp4", "qwix_fp8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peer:
    """A peer's GEMM as a policy-like object (hashable: a static argument)."""

    name: str
    needs_key: bool = False

    def dot_general(self, key=None):
        del key
        if self.name == "flax_fp8":
            return _flax_fp8
        if self.name.startswith("jax_"):
            return _scaled(self.name.removeprefix("jax_"))
        if self.name == "qwix_fp8":
            return _qwix_fp8
        raise ValueError(f"peer: unknown {self.name!r}; expected one of {PEERS}")


def unavailable_reason(name: str) -> str | None:
    """None if peer `name` can be built here, else why not."""
    if name not in PEERS:
        raise ValueError(f"peer: unknown {name!r}; expected one of {PEERS}")
    if name == "flax_fp8" and importlib.util.find_spec("flax") is None:
        return "flax is not installed"
    if name == "qwix_fp8" and importlib.util.find_spec("qwix") is None:
        return "qwix is not installed (pip install qwix; not an mxjax dependency)"
    return None


def get(name: str) -> Peer:
    why = unavailable_reason(name)
    if why:
        raise RuntimeError(f"peer {name!r}: {why}")
    return Peer(name=name)


def _flax_fp8(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
              **kwargs):
    from flax.linen import fp8_ops

    del precision, kwargs
    scale = jnp.ones((1,), jnp.float32)
    history = jnp.zeros((1024,), jnp.float32)  # Fp8DotGeneralBase.amax_history_length
    out = fp8_ops.fp8_scaled_dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type=lhs.dtype,
        lhs_scale=scale, rhs_scale=scale, grad_scale=scale, lhs_amax_history=history,
        rhs_amax_history=history, grad_amax_history=history, quantize_compute_type=lhs.dtype)
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def _scaled(mode: str):
    def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
            **kwargs):
        del precision, kwargs
        config = jax.nn.get_scaled_dot_general_config(mode)
        out = jax.nn.scaled_dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=lhs.dtype,
            configs=[config, config, config])
        return out if preferred_element_type is None else out.astype(preferred_element_type)

    return dot


def _qwix_fp8(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
              **kwargs):
    # qwix's quantized-training dot (what its QtProvider puts in a model's dot_generals);
    # qwix exports it only through the provider, hence the module path.
    from qwix._src.core import dot_general_qt

    del precision, kwargs
    config = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
        dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2)
    out = dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, config)
    return out if preferred_element_type is None else out.astype(preferred_element_type)
