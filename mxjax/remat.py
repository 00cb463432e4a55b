"""Remat (``jax.checkpoint``) policies that know mxjax's packed residuals.

A quantized ``mxjax.dot_general`` saves, where its backward GEMM would quantize exactly the
values it saved, the quantized packed operand instead of the bf16 input
(`mxjax.residuals`). Each such residual is named :data:`PACKED_RESIDUAL` with
``jax.ad_checkpoint.checkpoint_name``. A remat policy that saves nothing (or only dots, as
MaxText's and Transformer Engine's common ones do) drops them and recomputes the forward,
quantization included, in the backward pass; :func:`remat_policy` ('quantized_residuals')
keeps them, so the backward reads 4.25 bits per element instead of recomputing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

__all__ = ["PACKED_RESIDUAL", "REMAT_POLICIES", "remat_policy"]

# The checkpoint_name of every packed residual (codes, scales, tensor scale).
PACKED_RESIDUAL = "mxjax_packed_residual"

REMAT_POLICIES: tuple[str, ...] = ("full", "quantized_residuals")


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy called `name`.

    * ``'full'``: nothing saved, the whole block recomputed in the backward pass
      (None: ``jax.checkpoint``'s default);
    * ``'quantized_residuals'``: the packed residuals of mxjax's quantized GEMMs saved
      (``save_only_these_names(PACKED_RESIDUAL)``), everything else recomputed.
    """
    if name == "full":
        return None
    if name == "quantized_residuals":
        return jax.checkpoint_policies.save_only_these_names(PACKED_RESIDUAL)
    raise ValueError(f"remat policy: expected one of {REMAT_POLICIES}, got {name!r}")
