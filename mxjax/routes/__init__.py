"""The execution routes of a quantized GEMM on accelerators: one module per route.

`mxjax.gemm` chooses the route, in one place (`mxjax.gemm._backend_fn`, and per lowering
platform `mxjax.kernels.backends_per_platform`); each route computes the same GEMM (bit
for bit, or within the bound docs/NUMERICS.md states for it):

==================  =====================================================================
module              route
==================  =====================================================================
`in_place_values`   the emulation's f32 MX values from block amaxes (shared by its forms)
`in_place_tpu`      the emulation's TPU form: the Pallas TPU quantize kernel
`in_place`          the emulation's GPU form (XLA fusions, operands quantized in place)
                    and the emulated GEMM on GPUs and TPUs (backend 'xla')
`fp8_units`         FP8 recipes (per-tensor FP8, MXFP8) on CUDA's FP8 tensor cores
`xla_fp8`           backend 'xla_fp8': MXFP4 carried exactly in FP8 on XLA's FP8 GEMM
`xla_fp4`           backend 'xla_fp4': MXFP4 re-encoded exactly as NVFP4 for XLA's
                    block-scaled dot (cuDNN's FP4 MMA on Blackwell)
`xla_fp4_kernel`    its operands on GPUs: one Pallas kernel per operand, both directions
                    from one read (loaded on first use)
==================  =====================================================================

The kernel backends ('pallas', 'pallas_fp8', 'triton') are `mxjax.kernels`, loaded on
first use. The CPU form of the emulation (canonical operands) is `mxjax.gemm`'s.
"""
