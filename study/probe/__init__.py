"""Mechanism probe: what each policy does to every GEMM of a real model, and why.

The per-GEMM error statistics of ``mxjax.diagnostics`` (operand error, output
cosine) can rank policies opposite to what training does. This probe measures
what they leave out, on the real model at fixed parameters:

* ``gain`` (``<policy, exact> / |exact|^2``) and ``err_cos`` (cosine of the
  error with the exact product): whether the quantized GEMM is *biased* (e.g. a
  shrunk gradient), not just noisy;
* ``err_corr_batches``: the cosine between the error matrices of the same GEMM
  on two batches at the same parameters. A structured error that does not
  average out across steps (the same direction every step) shows up here;
  randomized policies get a different key per batch, as in training;
* ``common_share`` of each operand along the contraction (the energy in its
  per-16-block means, :func:`mxjax.diagnostics.block_mean_share`) and
  ``noncommon_err``/``common_err``: the operand's quantization error (with
  any rotation undone) restricted to the complement of / to that block-mean
  subspace, plus ``flush``/``flushed_energy``: the share of nonzero
  (rotated) entries, and of their energy, that quantize to zero. They test the
  hypothesis that a deterministic H16 puts a block's common component into one
  coefficient, which then sets the MX scale and flushes the varying part;
* an implementation check per GEMM: ``rot_only_dev`` (the same GEMM with the
  policy's Hadamard and no quantization, through ``mxjax.gemm.gemm``, against
  the exact product) and ``ref_dev`` (the policy GEMM against a reference
  built here: float64 rotation with a Sylvester matrix from ``np.kron``,
  ``mxjax.fake_quantize`` of each operand along the contraction, float64
  product). Both are ``max |a - b| / max |b|``: ~1e-7 means agreement to fp32
  rounding. The float64 rotation can put an element that lies within an fp32
  ulp of an E2M1 rounding (or scale) boundary on the other side of it, which
  moves a few outputs by one grid step; so rotated GEMMs also get ``ref32_dev``
  (the same reference from the fp32 rotation ``mxjax.hadamard`` computes, the
  values the GEMM quantizes) and ``ref_flips`` (the share of quantized operand
  elements on which the two routes differ). Nothing raises: the numbers go in
  the report (the strict version is tests/study/test_study_probe.py).

How: the loss (mean token cross-entropy, as ``train.step``) and its gradient
run jitted with an observer (``mxjax.interceptor.observe``) that wraps every
quantized ``dot_general`` in a custom VJP; ``jax.debug.callback`` sends its
operands, the forward cotangent and the policy's three GEMM results to the
host, where everything above is computed in float64 numpy. Labels follow
``train.diagnostics.numerics.llama_slot_labels``; a call site inside the layer
scan runs once per layer and each execution is labelled with its layer
(``L0.q_proj``, found by matching W against the stacked kernels).

Modules: ``capture`` (the observer and the instrumented loss and gradient:
every quantized GEMM's operands and results on the host), ``analysis`` (the
float64 host analysis of one captured GEMM), ``mechanism`` (the probe over
policies and batches, its text table, and the study's call at the branch
points). The public names are re-exported here.
"""

from study.probe.analysis import COMMON_BLOCK, analyze_gemm, operand_treatment, sylvester
from study.probe.capture import GemmCapture, capture_gemms
from study.probe.mechanism import (
    PROBE_POLICIES,
    error_correlation_sums,
    format_table,
    mechanism_probe,
    run_probe,
    summarize_row,
)

__all__ = ["COMMON_BLOCK", "PROBE_POLICIES", "GemmCapture", "analyze_gemm", "capture_gemms",
           "error_correlation_sums", "format_table", "mechanism_probe", "operand_treatment",
           "run_probe", "summarize_row", "sylvester"]
