"""tests/mxjax: import what the first quantized GEMM trace would import.

Tracing a quantized GEMM traces its TPU form too (mxjax._platform.per_platform), whose
kernel (mxjax.accelerator_tpu) imports jax.experimental.pallas on first use. Pallas adds
its config options to JAX's tracing context, so every jitted function traced before that
import misses the cache when called again afterwards and compiles a second time (e.g. a
module's shared program traced in a worker's first quantized test, called again by the
next parametrized case). Importing Pallas here keeps the context fixed for the session.
"""

from jax.experimental import pallas  # noqa: F401
from jax.experimental.pallas import tpu  # noqa: F401
