"""Dimension numbers of ``lax.dot_general``: validation and the backward GEMMs' numbers.

``normalize_dimension_numbers`` checks ``((lhs_contracting, rhs_contracting),
(lhs_batch, rhs_batch))`` against the operand shapes; ``backward_dimension_numbers``
derives the dgrad and wgrad GEMMs' numbers and output permutations from JAX's
transpose rule for ``dot_general`` (``_dot_general_transpose_lhs`` / ``_rhs``),
for any batch dims and several or non-trailing contracting dims.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Dims", "backward_dimension_numbers", "free_axes", "normalize_dimension_numbers"]


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


def free_axes(n: int, *removed: Sequence[int]) -> list[int]:
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
    x_kept = free_axes(x_ndim, x_contract, x_batch)
    y_kept = free_axes(y_ndim, y_contract, y_batch)
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

