"""The library's presets: the paper's ladder and peers' recipes, one builder each.

Each builder's docstring says where the recipe comes from; :data:`PRESETS` maps names to
builders in ladder order. The ladder study's ablations are the study's
(``study.policies``), built from these.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping

from mxjax.formats import BF16, FP8_E4M3, FP8_E5M2, MXFP4, MXFP8_E4M3, NVFP4, Rounding, ScaleRule
from mxjax.policies.policy import PrecisionPolicy
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe

__all__ = ["PRESETS", "fp8", "mxfp4_all", "mxfp4_all_h16", "mxfp4_all_h16_wgrad",
           "mxfp4_all_h32", "mxfp4_all_rht16", "mxfp4_all_sr", "mxfp4_fprop",
           "mxfp4_fprop_dgrad", "mxfp8", "names", "nvfp4", "passthrough", "summary", "tseng"]


_PT = OperandRecipe(fmt=BF16)
_PASS = GemmRecipe(lhs=_PT, rhs=_PT)
_MX = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN)
_MX_SR = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN, rounding=Rounding.STOCHASTIC)
_MXGEMM = GemmRecipe(lhs=_MX, rhs=_MX)


def _mx_gemm(hadamard: Hadamard | None = None) -> GemmRecipe:
    return GemmRecipe(lhs=_MX, rhs=_MX, hadamard=hadamard)


def passthrough() -> PrecisionPolicy:
    """No quantization: all three GEMMs are plain ``lax.dot_general`` (bit for bit).

    fprop (X, W), dgrad (dY, W), wgrad (dY, X): pass-through, no Hadamard. Nothing
    is cast: an f32 model stays f32, a bf16 model stays bf16 (to compute in bf16,
    set the model's dtype). ``'none'`` (no policy) computes the same values. Formerly
    ``bf16`` (still accepted, deprecated: it named a dtype it never cast to).
    """
    return PrecisionPolicy(fprop=_PASS, dgrad=_PASS, wgrad=_PASS, name="passthrough")


def fp8() -> PrecisionPolicy:
    """The FP8 baseline (the paper's reference run): per-tensor current scaling.

    fprop: X and W in FP8 E4M3. dgrad: dY in FP8 E5M2, W in E4M3. wgrad: dY in
    E5M2, X in E4M3. Scale = amax of the tensor now / max_normal (fp32); elements
    round to nearest-even and saturate. No Hadamard.
    """
    e4 = OperandRecipe(fmt=FP8_E4M3)
    e5 = OperandRecipe(fmt=FP8_E5M2)
    return PrecisionPolicy(
        fprop=GemmRecipe(lhs=e4, rhs=e4),
        dgrad=GemmRecipe(lhs=e5, rhs=e4),
        wgrad=GemmRecipe(lhs=e5, rhs=e4),
        name="fp8",
    )


def mxfp4_fprop() -> PrecisionPolicy:
    """Paper's ladder, step 1: MXFP4 in the forward GEMM only (paper: +8–9% tokens vs FP8).

    fprop: X and W in MXFP4 (E2M1, E8M0 scale per 32 along K), EVEN scales,
    nearest-even. dgrad and wgrad: pass-through. No Hadamard.
    """
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=_PASS, wgrad=_PASS, name="mxfp4_fprop")


def mxfp4_fprop_dgrad() -> PrecisionPolicy:
    """Paper's ladder, step 2: MXFP4 in fprop and dgrad (paper: +10–11% tokens).

    fprop: X, W in MXFP4 blocked along K. dgrad: dY, W in MXFP4 blocked along N.
    EVEN scales, nearest-even. wgrad: pass-through. No Hadamard.
    """
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=_MXGEMM, wgrad=_PASS, name="mxfp4_fprop_dgrad")


def mxfp4_all() -> PrecisionPolicy:
    """Paper's ladder, step 3: MXFP4 in all three GEMMs, no stabilization (paper: +26–27%).

    fprop: X, W blocked along K; dgrad: dY, W along N; wgrad: dY, X along M
    (tokens). All MXFP4, EVEN scales, nearest-even, no Hadamard.
    """
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=_MXGEMM, wgrad=_MXGEMM, name="mxfp4_all")


def mxfp4_all_sr() -> PrecisionPolicy:
    """Paper's stochastic-rounding row: MXFP4 everywhere, SR in the backward GEMMs.

    fprop: X, W MXFP4 nearest-even. dgrad (dY, W) and wgrad (dY, X): MXFP4 with
    stochastic rounding (no pre-scale). EVEN scales throughout, no Hadamard.
    Needs a key. The paper reports that this does not converge once wgrad is
    MXFP4.
    """
    sr = GemmRecipe(lhs=_MX_SR, rhs=_MX_SR)
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=sr, wgrad=sr, name="mxfp4_all_sr")


def mxfp4_all_rht16() -> PrecisionPolicy:
    """Paper's randomized-Hadamard row: MXFP4 everywhere with a random-sign H16.

    All three GEMMs: both operands rotated by H16 with a fresh ±1 sign vector per
    call (per GEMM, layer and step via the key) along the GEMM's contraction,
    then MXFP4 with EVEN scales, nearest-even. Needs a key. The paper reports
    that this does not converge once wgrad is MXFP4.
    """
    g = _mx_gemm(Hadamard(block_size=16, randomized=True))
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp4_all_rht16")


def mxfp4_all_h16() -> PrecisionPolicy:
    """The paper's recipe: deterministic H16 on every operand of all three GEMMs.

    fprop (X, W along K), dgrad (dY, W along N), wgrad (dY, X along M): both
    operands rotated by the fixed Sylvester H16 (no signs), so each 32-element
    MXFP4 block is two rotated 16-halves; then MXFP4 with EVEN scales and
    nearest-even rounding. Deterministic (no key). Paper: +8–9% tokens with all
    three GEMMs in MXFP4, +20% step throughput on MI355X.
    """
    g = _mx_gemm(Hadamard(block_size=16))
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp4_all_h16")


def mxfp4_all_h32() -> PrecisionPolicy:
    """The paper's recipe with a deterministic H32 (one rotation per MXFP4 block).

    As ``mxfp4_all_h16`` with the fixed Sylvester H32 (no signs) on both operands
    of all three GEMMs; MXFP4, EVEN scales, nearest-even. Paper: about as good
    as H16.
    """
    g = _mx_gemm(Hadamard(block_size=32))
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp4_all_h32")


def mxfp4_all_h16_wgrad() -> PrecisionPolicy:
    """MXFP4 in all three GEMMs, deterministic H16 on wgrad only (tests the
    paper's claim that the instability lives on the wgrad path).

    fprop (X, W) and dgrad (dY, W): MXFP4, no Hadamard. wgrad (dY, X): fixed H16
    along M, then MXFP4. EVEN scales, nearest-even throughout. Deterministic.
    Formerly ``mxfp4_wgrad_h16`` (still accepted, deprecated).
    """
    return dataclasses.replace(mxfp4_all(), wgrad=_mx_gemm(Hadamard(block_size=16)),
                               name="mxfp4_all_h16_wgrad")


def nvfp4() -> PrecisionPolicy:
    """NVIDIA's NVFP4 training recipe, as far as per-operand recipes express it.

    All three GEMMs in NVFP4 (E2M1, E4M3 scale per 16, fp32 per-tensor scale).
    fprop (X, W): nearest-even, no Hadamard. dgrad (dY, W): dY stochastic
    rounding, W nearest-even, no Hadamard. wgrad (dY, X): 16×16 Hadamard with a
    fixed random sign vector (seed 0, the same every step) on both operands along
    M, dY stochastic rounding, X nearest-even. Needs a key (for the SR).

    Not expressible here: NVIDIA quantizes weights in 2-D 16×16 blocks so fprop
    and dgrad share one quantized W; mxjax quantizes W with 1×16 blocks along each
    GEMM's own contraction (K for fprop, N for dgrad). NVIDIA also keeps the last
    few layers in BF16: use ``mxjax.nn.wrap`` rules for that.
    """
    rne = OperandRecipe(fmt=NVFP4)
    sr = OperandRecipe(fmt=NVFP4, rounding=Rounding.STOCHASTIC)
    return PrecisionPolicy(
        fprop=GemmRecipe(lhs=rne, rhs=rne),
        dgrad=GemmRecipe(lhs=sr, rhs=rne),
        wgrad=GemmRecipe(lhs=sr, rhs=rne, hadamard=Hadamard(block_size=16, seed=0)),
        name="nvfp4",
    )


def tseng() -> PrecisionPolicy:
    """Tseng et al. 2025, "Training LLMs with MXFP4": BF16 forward, MXFP4 backward.

    fprop: pass-through. dgrad (dY, W) and wgrad (dY, X): both operands rotated
    by a random-sign H64 (fresh signs per call) along the GEMM's contraction,
    then MXFP4 with OCP FLOOR scales and stochastic rounding with the 3/4
    pre-scale (so FLOOR never saturates). Needs a key.
    """
    sr = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.FLOOR, rounding=Rounding.STOCHASTIC,
                       sr_prescale=True)
    g = GemmRecipe(lhs=sr, rhs=sr, hadamard=Hadamard(block_size=64, randomized=True))
    return PrecisionPolicy(fprop=_PASS, dgrad=g, wgrad=g, name="tseng")


def mxfp8() -> PrecisionPolicy:
    """MXFP8 everywhere, as NVIDIA publishes it: E4M3 x E8M0 per 32, RCEIL scales.

    fprop (X, W), dgrad (dY, W), wgrad (dY, X): MXFP8 E4M3 operands (gradients
    included) with round-up (RCEIL) scales and round-to-nearest-even elements, no
    Hadamard. Sources: Mishra et al., "Recipes for Pre-training LLMs with MXFP8"
    (arXiv 2506.08027: E4M3 for all tensors with scales rounded up matched BF16 on an
    8B model over 15T tokens, where OCP's FLOOR scales diverged), and Transformer
    Engine's ``MXFP8BlockScaling`` default (E4M3 forward and backward: the 32-element
    blocks give gradients the range that E5M2 gives per-tensor FP8). On CUDA the GEMMs
    go through ``jax.nn.scaled_matmul``: cuDNN's block-scaled MMA on Blackwell, XLA's
    dequantize + f32 GEMM on Hopper; other platforms run the emulation
    (docs/NUMERICS.md, "FP8 GEMMs on FP8 tensor cores").
    """
    e4 = OperandRecipe(fmt=MXFP8_E4M3, scale_rule=ScaleRule.RCEIL)
    g = GemmRecipe(lhs=e4, rhs=e4)
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp8")


PRESETS: Mapping[str, Callable[[], PrecisionPolicy]] = types.MappingProxyType({
    f.__name__: f
    for f in (
        # the paper's ladder (fp8 is its baseline)
        passthrough, fp8, mxfp4_fprop, mxfp4_fprop_dgrad, mxfp4_all, mxfp4_all_sr,
        mxfp4_all_rht16, mxfp4_all_h16, mxfp4_all_h32,
        # the paper's claim, located: H16 on the wgrad path only
        mxfp4_all_h16_wgrad,
        # peers' recipes
        mxfp8, nvfp4, tseng,
    )
})


def names() -> tuple[str, ...]:
    """Names of all presets, in ladder order (deprecated aliases excluded)."""
    return tuple(PRESETS)


def summary(name: str) -> str:
    """What preset `name` is, in one line: its builder's first docstring paragraph
    (``python -m train --list-policies`` prints one per preset). A KeyError names an
    unknown `name` and the valid ones."""
    if name not in PRESETS:
        raise KeyError(f"summary: unknown preset {name!r}; valid names: {', '.join(PRESETS)}")
    doc = inspect.getdoc(PRESETS[name]) or ""
    return " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "")
