"""Precision policies: the PrecisionPolicy type, its presets and its dict form, one module each.

A :class:`PrecisionPolicy` holds one ``mxjax.recipes.GemmRecipe`` per GEMM of a
linear layer (fprop, dgrad, wgrad). It runs through the interceptor
(``mxjax.interceptor``, the layer below): ``policy.dot_general(key)`` and
:func:`dot_general` (which also takes a preset name) call it, so the recipe
types never import the interceptor.

Presets (``get(name)``; ``print(get(name).describe())`` prints what every operand
gets; each builder's docstring says where the recipe comes from). "MXFP4" below is
E2M1 with an E8M0 scale per 32 along the GEMM's contraction, EVEN scales,
nearest-even; "H16" is the fixed Sylvester Hadamard of size 16 on both operands:

========================  ==============================================================
name                      what it does
========================  ==============================================================
passthrough               no quantization: plain ``lax.dot_general`` (nothing is cast)
fp8                       FP8 per-tensor: E4M3 X, W; E5M2 dY (the paper's baseline)
mxfp4_fprop               MXFP4 in fprop; dgrad, wgrad pass-through
mxfp4_fprop_dgrad         MXFP4 in fprop and dgrad; wgrad pass-through
mxfp4_all                 MXFP4 in all three GEMMs, no rotation
mxfp4_all_sr              MXFP4 everywhere, stochastic rounding in dgrad and wgrad (key)
mxfp4_all_rht16           MXFP4 everywhere, random-sign H16 on every GEMM (key)
mxfp4_all_h16             the paper's recipe: MXFP4 everywhere, H16 on every GEMM
mxfp4_all_h32             MXFP4 everywhere, H32 on every GEMM
mxfp4_all_h16_wgrad       MXFP4 everywhere, H16 on wgrad only
mxfp8                     MXFP8 E4M3 everywhere, RCEIL scales (NVIDIA's MXFP8 recipe)
nvfp4                     NVIDIA's NVFP4 recipe (SR on dY, fixed-sign H16 on wgrad; key)
tseng                     Tseng et al.: bf16 fprop; MXFP4 backward, random H64, SR x3/4
========================  ==============================================================

The ladder study's ablations (MXFP4 in wgrad only, H16 on one GEMM, ...) are the
study's (``study.policies``), not library presets. Deprecated names
(`mxjax.policies.aliases`; they still work and warn with the new name):
``bf16`` → ``passthrough`` (it never cast to bf16: an f32 model stays f32; to compute in
bf16 set the model's dtype), ``mxfp4_wgrad_h16`` → ``mxfp4_all_h16_wgrad``.
``"none"`` (:func:`resolve`) means no policy at all; it computes what
``passthrough`` computes.

One spec everywhere: :func:`resolve` takes a preset name, ``"none"``/None, a
dict (:func:`to_dict`'s layout) or a PrecisionPolicy, and so do
``mxjax.nn.wrap``, ``mxjax.nn.Rule``, the train config's ``policy:`` and the
study's policy lists.

The paper is "Pretraining large language models with MXFP4 on Native FP4
Hardware" (arXiv 2605.09825). Its MI355X kernels compute E8M0 scales with the
EVEN rule (torchao's EVEN: round amax to the element mantissa width, then
floor) and round elements to nearest-even, so every ``mxfp4_*`` preset uses
EVEN scales and nearest-even rounding unless it says otherwise.

Modules: `policy` (the type), `presets` (the builders, :data:`PRESETS`), `aliases`
(deprecated names), `dict_form` (plain dicts), `lookup` (`get`, `resolve`,
`dot_general`); this package re-exports their public names.
"""

from mxjax.policies.aliases import ALIASES, canonical_name
from mxjax.policies.lookup import dot_general, from_dict, get, resolve, to_dict
from mxjax.policies.policy import GemmSpec, PrecisionPolicy
from mxjax.policies.presets import PRESETS, names, summary

__all__ = ["ALIASES", "PRESETS", "GemmSpec", "PrecisionPolicy", "canonical_name",
           "dot_general", "from_dict", "get", "names", "resolve", "summary", "to_dict"]
