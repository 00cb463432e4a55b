"""Scripts that run on an accelerator: bench/device/gpu.py (correctness tests, then the
measured tables), its harness (clock, table, time budget) and one module per section."""
