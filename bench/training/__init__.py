"""What a training run on this CPU shows: measurements taken while the tiny config trains
(`carrier_windows`: how often the exact carriers hold its GEMM operands)."""
