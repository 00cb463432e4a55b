"""Host analysis of one captured GEMM, in float64: error sums, common-subspace
measures and the implementation checks (see the package docstring for the fields)."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mxjax.quantization import fake_quantize_with
from mxjax.recipes import Hadamard, OperandRecipe
from study.probe.capture import GemmCapture

__all__ = ["COMMON_BLOCK", "analyze_gemm", "operand_treatment", "sylvester"]

COMMON_BLOCK = 16  # the block of the common (block-mean) subspace: H16's first coefficient


def sylvester(h: int) -> np.ndarray:
    """Unnormalized Sylvester Hadamard matrix of size h (float64), built with np.kron."""
    if h < 1 or h & (h - 1):
        raise ValueError(f"h: expected a power of two, got {h}")
    mat = np.ones((1, 1))
    while mat.shape[0] < h:
        mat = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), mat)
    return mat


def _pad_k(x: np.ndarray, mult: int) -> np.ndarray:
    pad = (-x.shape[-1]) % mult
    if not pad:
        return x
    return np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], axis=-1)


def _rotate(x: np.ndarray, h: int, signs: np.ndarray | None, inverse: bool = False) -> np.ndarray:
    """Block-diagonal (1/sqrt h) H diag(signs) along the last axis, float64 (x padded to h)."""
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // h, h))
    hm = sylvester(h) / math.sqrt(h)  # symmetric: H^T = H
    if inverse:  # (H D)^-1 = D H
        yb = xb @ hm
        if signs is not None:
            yb = yb * signs
    else:
        yb = (xb * signs if signs is not None else xb) @ hm
    return yb.reshape(x.shape)


@functools.lru_cache(maxsize=64)
def _fq_fn(op: OperandRecipe):
    def f(x, key):
        return fake_quantize_with(x, op, -1, key=key)

    return jax.jit(f)


@functools.lru_cache(maxsize=16)
def _lib_rotate_fn(h: int, has_signs: bool):
    from mxjax.rotation import hadamard

    def f(x, signs):
        return hadamard(x, h, axis=-1, signs=signs if has_signs else None)

    return jax.jit(f)


def operand_treatment(x: np.ndarray, op: OperandRecipe, had: Hadamard | None,
                      signs: np.ndarray | None, key=None) -> dict[str, np.ndarray]:
    """What a GEMM does to one canonical operand [..., K], in float64.

    Returns ``rot`` (the operand rotated by the float64 Sylvester rotation, K
    zero-padded to the Hadamard size; ``x`` itself without a Hadamard), ``q``
    (``mxjax.fake_quantize`` of ``rot`` rounded to f32, along K, under ``op``
    with the rounding key ``key``) and ``eff`` (``q`` rotated back and cut to
    K: the operand the GEMM effectively multiplies, in the original basis).
    """
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    if had is not None:
        rot = _rotate(_pad_k(x, had.block_size), had.block_size, signs)
    else:
        rot = x
    if op.is_passthrough:
        q = rot.astype(np.float32).astype(np.float64) if had is not None else x
    else:
        q = np.asarray(_fq_fn(op)(jnp.asarray(rot.astype(np.float32)), key), np.float64)
    eff = _rotate(q, had.block_size, signs, inverse=True)[..., :k] if had is not None else q
    return {"rot": rot, "q": q, "eff": eff}


def _block_mean(xp: np.ndarray, block: int) -> np.ndarray:
    """Projection of xp [..., K] (K a multiple of block) onto its per-block means."""
    xb = xp.reshape(xp.shape[:-1] + (xp.shape[-1] // block, block))
    return np.broadcast_to(xb.mean(axis=-1, keepdims=True), xb.shape).reshape(xp.shape)


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[batch..., Fa, K] x [batch..., Fb, K] -> [batch..., Fa, Fb], float64."""
    return np.matmul(a, np.swapaxes(b, -1, -2))


def _maxdev(a: np.ndarray, ref: np.ndarray) -> float:
    m = float(np.max(np.abs(ref))) if ref.size else 0.0
    d = float(np.max(np.abs(a - ref))) if ref.size else 0.0
    return d / m if m > 0 else d


def analyze_gemm(cap: GemmCapture, *, impl_check: bool = True,
                 common_block: int = COMMON_BLOCK) -> dict[str, Any]:
    """Sums and checks of one captured GEMM (float64, host).

    Returns a dict of sums (``s_*``, to be combined over batches and call
    sites), the error matrix ``err`` (policy − exact, for ``err_corr_batches``)
    and the implementation checks ``rot_only_dev``, ``ref_dev``, ``ref32_dev``,
    ``ref_flips`` (module docstring; None where the GEMM has no Hadamard or
    nothing to check).
    """
    r = cap.recipe
    a = np.asarray(cap.a, np.float64)
    b = np.asarray(cap.b, np.float64)
    out = np.asarray(cap.out, np.float64)
    exact = _mm(a, b)
    err = out - exact
    s = {"s_exact2": float(np.sum(exact * exact)), "s_err2": float(np.sum(err * err)),
         "s_out_exact": float(np.sum(out * exact)), "s_err_exact": float(np.sum(err * exact))}
    had = r.hadamard
    signs = None if had is None or cap.signs is None else np.asarray(cap.signs, np.float64)
    k_lhs, k_rhs = cap.lhs_key, cap.rhs_key
    treated = {}
    for side, x, op, k in (("lhs", a, r.lhs, k_lhs), ("rhs", b, r.rhs, k_rhs)):
        t = operand_treatment(x, op, had, signs, k if op.needs_key else None)
        treated[side] = t
        # The common subspace lives in the zero-padded space, as the rotation sees it
        # (so common_share equals mxjax.diagnostics.block_mean_share).
        xp = _pad_k(x, common_block)
        d = _pad_k(t["eff"] - x, common_block)
        xm = _block_mean(xp, common_block)
        dm = _block_mean(d, common_block)
        nz = t["rot"] != 0
        flushed = nz & (t["q"] == 0)
        s.update({
            f"s_{side}_x2": float(np.sum(x * x)),
            f"s_{side}_common2": float(np.sum(xm * xm)),
            f"s_{side}_err2": float(np.sum(d * d)),
            f"s_{side}_err_common2": float(np.sum(dm * dm)),
            f"s_{side}_err_noncommon2": float(np.sum((d - dm) ** 2)),
            f"s_{side}_noncommon2": float(np.sum((xp - xm) ** 2)),
            f"s_{side}_nz": float(np.sum(nz)),
            f"s_{side}_flushed": float(np.sum(flushed)),
            f"s_{side}_rot2": float(np.sum(t["rot"] ** 2)),
            f"s_{side}_flushed2": float(np.sum(np.where(flushed, t["rot"], 0.0) ** 2)),
        })
    res: dict[str, Any] = {"sums": s, "err": err, "rot_only_dev": None, "ref_dev": None,
                           "ref32_dev": None, "ref_flips": None}
    if impl_check and not r.is_passthrough:
        ref = _mm(treated["lhs"]["q"], treated["rhs"]["q"])
        res["ref_dev"] = _maxdev(out, ref)
        if had is not None:
            if cap.rot_only is not None:  # the GEMM's Hadamard without quantization
                res["rot_only_dev"] = _maxdev(np.asarray(cap.rot_only, np.float64), exact)
            # The same reference from the fp32 rotation the GEMM itself quantizes: it
            # separates a fault from an element that sits within an fp32 ulp of a rounding
            # or scale boundary, which the float64 rotation may put on the other side.
            q32, changed, n = [], 0, 0
            for side, x, op, k in (("lhs", a, r.lhs, k_lhs), ("rhs", b, r.rhs, k_rhs)):
                xr = _lib_rotate_fn(had.block_size, signs is not None)(
                    jnp.asarray(_pad_k(np.asarray(x, np.float32), had.block_size)),
                    None if signs is None else jnp.asarray(signs, jnp.float32))
                q = (np.asarray(xr, np.float64) if op.is_passthrough else np.asarray(
                    _fq_fn(op)(xr, k if op.needs_key else None), np.float64))
                q32.append(q)
                changed += int(np.sum(q != treated[side]["q"]))
                n += q.size
            res["ref32_dev"] = _maxdev(out, _mm(q32[0], q32[1]))
            res["ref_flips"] = changed / n
    return res
