"""Training diagnostics a run can record beside its losses.

``dynamics``: per-layer gradient norms, gradient-collapse rate, relative update
size (jit-friendly pytree reductions used inside the step) and the instability
detector (a host-side state machine over gradient norms). The per-GEMM
quantization statistics themselves are ``mxjax.diagnostics``'.
"""
