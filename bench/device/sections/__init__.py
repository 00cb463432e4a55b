"""The sections of bench/device/gpu.py, one module each, in the order they run:
gpu_tests, ceilings, layer8b, quantize, gemm, train, calibration."""
