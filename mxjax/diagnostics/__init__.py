"""Numerics diagnostics: what quantization does to each GEMM of a step (opt-in).

Two parts:

* ``mxjax.diagnostics.gemm_stats``: quantization statistics of one GEMM's
  operands (relative error, underflow, saturation, scale exponents, output
  cosine), pure ``jnp``.
* ``mxjax.diagnostics.probes``: collection of those statistics for every
  quantized GEMM inside a jitted, differentiated step, through the
  interceptor's one hook (``mxjax.interceptor.observe``).

Training dynamics (per-layer gradient norms, collapse rate, update sizes, the
instability detector) live in ``train.diagnostics.dynamics``.
"""

from mxjax.diagnostics.gemm_stats import (
    GEMM_FIELDS,
    N_GEMM_FIELDS,
    OPERAND_STATS,
    block_mean_share,
    cosine_similarity,
    gemm_stats,
    operand_stats,
    operand_stats_vector,
    quantized_operand_stats,
    safe_ratio,
)
from mxjax.diagnostics.probes import (
    DiagnosticsConfig,
    collect,
    count_slots,
    init_probes,
    instrument,
    next_probe,
    probed_call,
    record_gemm,
    summarize_probes,
    value_and_grad_with_stats,
)

__all__ = [
    "GEMM_FIELDS",
    "N_GEMM_FIELDS",
    "OPERAND_STATS",
    "DiagnosticsConfig",
    "block_mean_share",
    "collect",
    "cosine_similarity",
    "count_slots",
    "gemm_stats",
    "init_probes",
    "instrument",
    "next_probe",
    "operand_stats",
    "operand_stats_vector",
    "probed_call",
    "quantized_operand_stats",
    "record_gemm",
    "safe_ratio",
    "summarize_probes",
    "value_and_grad_with_stats",
]
