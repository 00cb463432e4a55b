"""The deviceless cost model: what a GPU or TPU would run, from compiles on this CPU.

Modules, lowest first (none imports one further down this list):

* ``aot``: ahead-of-time compiles for a chip (`aot.TARGETS`) without the chip;
* ``rates``: each chip's rates per GEMM operand class, HBM bandwidth and launch cost;
* ``hlo_kernels``: the kernels of an optimized HLO module, read from its text;
* ``ptx_cost``: threads and instructions of Triton kernels, from an XLA dump;
* ``calibration``: a device run's measurement file (``calibration/<chip>-<date>.json``), checked;
* ``calibrated``: the calibrated model, each kernel at a rate measured on a chip;
* ``calibration_compile``: compiles of the code a device run ran, for the calibrated model;
* ``tpu_kernel_cycles``: static cycles of mxjax's TPU kernels (run as a subprocess);
* ``export_shape``: a decoder layer's train step, and its quantized GEMMs in StableHLO;
* ``peers``: other projects' low-precision GEMMs as policy-like objects;
* ``programs``: the programs the bench compiles and times (matmul, 1B and 8B layers, MLP);
* ``accelerator_cost``: one compile's row (`Cost`): kernels, bytes, the rooflines;
* ``targets``: the ratio bounds against bf16 and the verdicts that check them;
* ``native_fp4``: the native MXFP4 GEMM paths compiled for GPUs, and their instructions;
* ``quantize_cost``: one operand's GPU quantize passes: bytes, PTX and SASS per kernel;
* ``tpu_fusion``: a TPU kernel's static cycles with and without the input fusion of its
  convert;
* ``train_memory``: the trainer's train step compiled for a mesh of CPUs or GPUs, its
  ``memory_analysis()`` beside `train.memory`'s estimate.

The scripts in bench/ print what these compute; tests import them directly.
"""
