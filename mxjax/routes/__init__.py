"""The routes of a quantized GEMM: one module per backend, each ending with its ``ROUTE``.

Each module states which formats and chips its route serves, its GEMM, its
packed-operand dot (if any) and where its evidence is in ``mxjax/measurements.json``
(`mxjax.routes.spec.Route`). The registry `mxjax.backends` lists them and chooses
among them, in one place (`mxjax.backends.route_for`). Every route computes the same
GEMM (bit for bit, or within the bound docs/NUMERICS.md states for it):

==================  =====================================================================
module              route
==================  =====================================================================
`spec`              the `Route` record, and the GEMM shared by the in-place routes
`xla`               backend 'xla': the emulation (`mxjax.emulation`), every chip, format
`xla_fp8`           backend 'xla_fp8': MXFP4 carried exactly in FP8 on XLA's FP8 GEMM
`xla_fp4`           backend 'xla_fp4': MXFP4 re-encoded exactly as NVFP4 for XLA's
                    block-scaled dot (cuDNN's FP4 MMA on Blackwell)
`xla_fp4_kernel`    its operands on GPUs: one Pallas kernel per operand, both directions
                    from one read (loaded on first use)
`xla_nvfp4`         backend 'xla_nvfp4': NVFP4 as it is on XLA's block-scaled dot (cuDNN's
                    FP4 MMA on Blackwell), tensor scales on the f32 result
`xla_mxfp8`         backend 'xla_mxfp8': MXFP8 quantized in place for XLA's block-scaled
                    dot (cuDNN's MXFP8 MMA on Blackwell)
`triton`            backend 'triton': Triton's ``tl.dot_scaled`` through jax-triton (the
                    ``gpu`` extra; its kernel in `mxjax.kernels`, loaded on first use)
==================  =====================================================================
"""
