"""The canonical GEMM layout shared by the interceptor, the kernels and diagnostics.

Operands are ``[batch..., F, K]``: leading batch axes (the same on both sides),
one flattened free axis F and the flattened contraction K last, along which the
MX blocks run.
"""

from __future__ import annotations

__all__ = ["canonical_dimension_numbers"]


def canonical_dimension_numbers(n_batch: int):
    """``lax.dot_general`` dimension numbers of ``[batch..., Fa, K] x [batch..., Fb, K]``.

    Args:
      n_batch: number of leading batch axes (>= 0).
    Returns:
      ``(((n_batch + 1,), (n_batch + 1,)), (batch, batch))`` with ``batch =
      tuple(range(n_batch))``; the result is ``[batch..., Fa, Fb]``.
    """
    batch = tuple(range(n_batch))
    return ((n_batch + 1,), (n_batch + 1,)), (batch, batch)
