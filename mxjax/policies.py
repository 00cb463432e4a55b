"""Precision policies: the PrecisionPolicy type, its presets and its dict form.

A :class:`PrecisionPolicy` holds one ``mxjax.recipes.GemmRecipe`` per GEMM of a
linear layer (fprop, dgrad, wgrad). It runs through the interceptor
(``mxjax.interceptor``, the layer below): ``policy.dot_general(key)`` and
:func:`dot_general` (which also takes a preset name) call it, so the recipe
types never import the interceptor.

Presets: ``bf16``, ``fp8``, ``mxfp4_fprop``, ``mxfp4_fprop_dgrad``, ``mxfp4_all``,
``mxfp4_all_sr``, ``mxfp4_all_rht16``, ``mxfp4_all_h16`` (the paper's recipe),
``mxfp4_all_h32``, ``mxfp4_wgrad_h16``, ``nvfp4``, ``tseng``. Each builder's
docstring says where the recipe comes from and exactly what every operand gets;
``print(get(name).describe())`` prints it as a table.

The paper is "Pretraining large language models with MXFP4 on Native FP4
Hardware" (arXiv 2605.09825). Its MI355X kernels compute E8M0 scales with the
EVEN rule (torchao's EVEN: round amax to the element mantissa width, then
floor) and round elements to nearest-even, so every ``mxfp4_*`` preset uses
EVEN scales and nearest-even rounding unless it says otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from mxjax import formats as F
from mxjax import interceptor
from mxjax.formats import BF16, FP8_E4M3, FP8_E5M2, MXFP4, NVFP4, Rounding, ScaleRule
from mxjax.recipes import GEMMS, GemmRecipe, Hadamard, OperandRecipe
from mxjax.validation import check_keys

__all__ = ["PRESETS", "PrecisionPolicy", "dot_general", "from_dict", "get", "names", "resolve",
           "to_dict"]


def _coerce_gemm(value: Any, name: str) -> GemmRecipe:
    if not isinstance(value, GemmRecipe):
        raise TypeError(f"PrecisionPolicy: {name} must be a GemmRecipe, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Recipes for the three GEMMs of every dot_general it is applied to.

    Attributes:
      fprop: Y = X·W, operands (X, W), blocks along the forward contraction K.
      dgrad: dX = dY·Wᵀ, operands (dY, W), blocks along N (rhs free axes).
      wgrad: dW = Xᵀ·dY, operands (dY, X), blocks along M (lhs free axes).
      name: optional label (presets carry their name). Not part of equality or
        the hash: two policies with the same recipes are the same policy.

    Use ``policy.dot_general(key)`` for a drop-in ``lax.dot_general`` and
    ``print(policy.describe())`` for the 3×2 table of what each operand gets.
    """

    fprop: GemmRecipe
    dgrad: GemmRecipe
    wgrad: GemmRecipe
    name: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for g in GEMMS:
            _coerce_gemm(getattr(self, g), g)
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"PrecisionPolicy: name must be a str or None, got {self.name!r}")

    @property
    def gemms(self) -> dict[str, GemmRecipe]:
        """{'fprop': ..., 'dgrad': ..., 'wgrad': ...}."""
        return {g: getattr(self, g) for g in GEMMS}

    @property
    def needs_key(self) -> bool:
        """True when any GEMM uses STOCHASTIC rounding or a randomized Hadamard."""
        return any(r.needs_key for r in self.gemms.values())

    @property
    def is_passthrough(self) -> bool:
        """True when all three GEMMs are plain ``lax.dot_general`` (the bf16 policy)."""
        return all(r.is_passthrough for r in self.gemms.values())

    def describe(self) -> str:
        """The 3×2 table (GEMM × operand) of what each operand gets, as text."""
        operand_names = {"fprop": ("X", "W"), "dgrad": ("dY", "W"), "wgrad": ("dY", "X")}
        rows = []
        for g, r in self.gemms.items():
            ln, rn = operand_names[g]
            had = r.hadamard.describe() if r.hadamard else "-"
            rows.append((g, f"{ln}: {r.lhs.describe()}", f"{rn}: {r.rhs.describe()}", had,
                         r.backend))
        header = ("GEMM", "lhs", "rhs", "hadamard", "backend")
        widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
        fmt_row = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
        title = f"PrecisionPolicy {self.name!r}" if self.name else "PrecisionPolicy"
        lines = [title + (" (needs a PRNG key)" if self.needs_key else ""), fmt_row(header)]
        lines.append("  ".join("-" * w for w in widths))
        lines += [fmt_row(row) for row in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def dot_general(self, key=None):
        """A drop-in for ``jax.lax.dot_general`` under this policy.

        Args:
          key: PRNG key (typed or raw uint32); required when ``needs_key``.
        Returns:
          ``f(lhs, rhs, dimension_numbers, precision=None,
          preferred_element_type=None, **kwargs)``; ``operand_dtype`` and
          ``out_sharding`` are ``mxjax.interceptor.dot_general``'s, other
          keyword arguments are accepted and ignored.
        """
        if self.needs_key and key is None:
            raise ValueError(
                f"key: policy {self.name or ''!s} uses stochastic rounding or a randomized "
                "Hadamard; policy.dot_general(key) needs a PRNG key"
            )
        policy = self

        def policy_dot_general(lhs, rhs, dimension_numbers, precision=None,
                               preferred_element_type=None, **kwargs):
            return interceptor.dot_general(lhs, rhs, dimension_numbers, precision,
                                           preferred_element_type, policy=policy, key=key,
                                           **kwargs)

        policy_dot_general.policy = policy
        return policy_dot_general

    def replace(self, **changes) -> PrecisionPolicy:
        """A copy with some fields replaced (re-validated)."""
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------
_PT = OperandRecipe(fmt=BF16)
_PASS = GemmRecipe(lhs=_PT, rhs=_PT)
_MX = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN)
_MX_SR = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN, rounding=Rounding.STOCHASTIC)
_MXGEMM = GemmRecipe(lhs=_MX, rhs=_MX)


def _mx_gemm(hadamard: Hadamard | None = None) -> GemmRecipe:
    return GemmRecipe(lhs=_MX, rhs=_MX, hadamard=hadamard)


def bf16() -> PrecisionPolicy:
    """No quantization: all three GEMMs are plain ``lax.dot_general`` (bit for bit).

    fprop (X, W), dgrad (dY, W), wgrad (dY, X): pass-through, no Hadamard.
    """
    return PrecisionPolicy(fprop=_PASS, dgrad=_PASS, wgrad=_PASS, name="bf16")


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


def mxfp4_wgrad_h16() -> PrecisionPolicy:
    """MXFP4 everywhere, deterministic H16 on wgrad only (tests the paper's claim
    that the instability lives on the wgrad path).

    fprop (X, W) and dgrad (dY, W): MXFP4, no Hadamard. wgrad (dY, X): fixed H16
    along M, then MXFP4. EVEN scales, nearest-even throughout. Deterministic.
    """
    return PrecisionPolicy(
        fprop=_MXGEMM, dgrad=_MXGEMM, wgrad=_mx_gemm(Hadamard(block_size=16)),
        name="mxfp4_wgrad_h16",
    )


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


PRESETS: dict[str, Callable[[], PrecisionPolicy]] = {
    f.__name__: f
    for f in (bf16, fp8, mxfp4_fprop, mxfp4_fprop_dgrad, mxfp4_all, mxfp4_all_sr,
              mxfp4_all_rht16, mxfp4_all_h16, mxfp4_all_h32, mxfp4_wgrad_h16, nvfp4, tseng)
}


# --- MXFP8 (issue 35) ----------------------------------------------------------------
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
    from mxjax.formats import MXFP8_E4M3

    e4 = OperandRecipe(fmt=MXFP8_E4M3, scale_rule=ScaleRule.RCEIL)
    g = GemmRecipe(lhs=e4, rhs=e4)
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp8")


PRESETS = {**PRESETS, "mxfp8": mxfp8}
# --- end MXFP8 ------------------------------------------------------------------------


def names() -> tuple[str, ...]:
    """Names of all presets, in ladder order."""
    return tuple(PRESETS)


def get(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The preset called `name` (a PrecisionPolicy is returned unchanged).

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if isinstance(name, PrecisionPolicy):
        return name
    if isinstance(name, str) and name in PRESETS:
        return PRESETS[name]()
    raise ValueError(f"policy: unknown preset {name!r}; valid names: {', '.join(PRESETS)}")


def resolve(spec: str | Mapping[str, Any] | PrecisionPolicy | None) -> PrecisionPolicy | None:
    """The policy `spec` stands for: the one place a policy is looked up by name or dict.

    Args:
      spec: a preset name (:func:`names`); ``None`` or ``"none"`` (any case) for no
        policy; a dict in :func:`to_dict`'s layout (:func:`from_dict`); or a
        PrecisionPolicy (returned unchanged).
    Returns:
      A PrecisionPolicy, or None for no policy.
    Raises:
      ValueError: an unknown name (the message lists the valid ones) or a dict
        with unknown/missing keys or bad values (the message names the key).
      TypeError: any other kind of `spec`, or a dict entry of the wrong type.
    """
    if spec is None or isinstance(spec, PrecisionPolicy):
        return spec
    if isinstance(spec, str):
        if spec.lower() == "none":
            return None
        if spec in PRESETS:
            return PRESETS[spec]()
        raise ValueError(f"policy: unknown preset {spec!r}; valid names: none, "
                         f"{', '.join(PRESETS)}")
    if isinstance(spec, Mapping):
        return from_dict(spec)
    raise TypeError(f"policy: expected a preset name, None or 'none', a policy dict or a "
                    f"PrecisionPolicy, got {type(spec).__name__} {spec!r}")


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    policy: PrecisionPolicy | str | Mapping[str, Any],
    key: jax.Array | None = None,
    **kwargs,
) -> jax.Array:
    """``jax.lax.dot_general`` whose fprop, dgrad and wgrad follow `policy` (``mxjax.dot_general``).

    ``policy`` is anything :func:`resolve` takes except no policy (a
    PrecisionPolicy, a preset name or a policy dict); everything else is
    ``mxjax.interceptor.dot_general``'s (see there for shapes, dtypes and ``key``).
    """
    resolved = resolve(policy) if isinstance(policy, (str, Mapping)) else policy
    if not isinstance(resolved, PrecisionPolicy):
        raise TypeError(f"policy: expected a PrecisionPolicy, a preset name or a policy dict, "
                        f"got {policy!r}")
    policy = resolved
    return interceptor.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                   policy=policy, key=key, **kwargs)


# --------------------------------------------------------------------------- #
# Plain-dict I/O (for YAML configs)
# --------------------------------------------------------------------------- #
def _operand_to_dict(r: OperandRecipe) -> dict[str, Any]:
    return {"fmt": r.fmt.name, "scale_rule": r.scale_rule.value, "rounding": r.rounding.value,
            "sr_prescale": r.sr_prescale}


def _gemm_to_dict(g: GemmRecipe) -> dict[str, Any]:
    had = g.hadamard
    return {
        "lhs": _operand_to_dict(g.lhs),
        "rhs": _operand_to_dict(g.rhs),
        "hadamard": None if had is None else {"block_size": had.block_size,
                                             "randomized": had.randomized, "seed": had.seed},
        "backend": g.backend,
    }


def to_dict(policy: PrecisionPolicy | str) -> dict[str, Any]:
    """A plain dict (str/bool/int/None leaves) that ``from_dict`` turns back into `policy`."""
    p = get(policy)
    d: dict[str, Any] = {"name": p.name}
    d.update({g: _gemm_to_dict(getattr(p, g)) for g in GEMMS})
    return d


def _operand_from(d: Any, where: str) -> OperandRecipe:
    if isinstance(d, str):
        return OperandRecipe(fmt=F.get(d))
    check_keys(d, {"fmt", "scale_rule", "rounding", "sr_prescale"}, {"fmt"}, where=where)
    return OperandRecipe(**d)


def _gemm_from(d: Any, where: str) -> GemmRecipe:
    check_keys(d, {"lhs", "rhs", "hadamard", "backend"}, {"lhs", "rhs"}, where=where)
    had = d.get("hadamard")
    if isinstance(had, Mapping):
        check_keys(had, {"block_size", "randomized", "seed"}, where=f"{where}.hadamard")
        had = Hadamard(**had)
    return GemmRecipe(
        lhs=_operand_from(d["lhs"], f"{where}.lhs"),
        rhs=_operand_from(d["rhs"], f"{where}.rhs"),
        hadamard=had,
        backend=d.get("backend", "xla"),
    )


def from_dict(d: Mapping[str, Any] | str) -> PrecisionPolicy:
    """Builds a PrecisionPolicy from ``to_dict``'s layout (or a preset name).

    Layout: ``{'name': str|None, 'fprop'|'dgrad'|'wgrad': {'lhs': operand,
    'rhs': operand, 'hadamard': None|int|{'block_size', 'randomized', 'seed'},
    'backend': 'xla'}}`` where an operand is a format name or ``{'fmt',
    'scale_rule', 'rounding', 'sr_prescale'}`` (missing fields take their
    defaults). Unknown keys are errors.
    """
    if isinstance(d, str):
        return get(d)
    check_keys(d, {"name", *GEMMS}, GEMMS, where="policy dict")
    return PrecisionPolicy(name=d.get("name"), **{g: _gemm_from(d[g], g) for g in GEMMS})
