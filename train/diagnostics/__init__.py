"""Training diagnostics a run can record beside its losses.

``dynamics``: per-layer gradient norms, gradient-collapse rate, relative update
size (jit-friendly pytree reductions used inside the step) and the instability
detector (a host-side state machine over gradient norms). ``numerics``: the
hooks a run with ``diagnostics.enabled`` records with (the per-GEMM
quantization statistics of ``mxjax.diagnostics`` plus the dynamics above, as
compact metrics fields), the names of the model's quantized GEMM call sites,
and the summary's readings of the records (instability point, means).
"""
