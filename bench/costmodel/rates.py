"""Peak rates per chip that bench/accelerator_cost.py's roofline charges kernels at.

Every figure is a vendor's published dense (no 2:4 sparsity) peak, with its source
beside it: matrix rates per operand type in FLOP/s, memory bandwidth in bytes/s, and a
per-kernel launch cost. They are assumptions, not measurements: no chip reaches them,
and the roofline states that wherever it prints a time. A rate that a chip lacks is
absent: a GEMM of that operand type runs on the units of the next wider type that the
chip has (:meth:`ChipRates.rate`; FP8 on an H200 runs FP8, FP4 on an H200 runs at its
FP8 rate at best and mxjax's Hopper paths upcast to bf16: the roofline charges what
the compiled program's operand types say).

Rate classes (operand types of one GEMM, both operands; mixed pairs take the wider):
``fp4`` (f4e2m1fn), ``fp8`` (any f8 type, block-scaled MXFP8 included), ``int8``,
``bf16`` (bf16, f16), ``tf32`` (f32 operands at XLA's DEFAULT precision on NVIDIA GPUs:
TF32 tensor cores; on TPUs one bf16 MXU pass, charged at the bf16 rate), ``f32``
(f64 operands; no chip here lists a rate for them).
"""

from __future__ import annotations

import dataclasses
import functools

__all__ = ["CHIP_RATES", "FALLBACK", "LAUNCH_S", "RATE_ORDER", "ChipRates", "rate_class",
           "rates_for"]

LAUNCH_S = 2e-6  # per kernel launch (GPU) or per fusion/custom call (TPU): an assumption

# Rate classes from narrowest to widest.
RATE_ORDER = ("fp4", "fp8", "int8", "bf16", "tf32", "f32")
# Where a chip without a class's units runs it: the first class of the chain it has
# (floats never fall to the integer units).
FALLBACK = {
    "fp4": ("fp4", "fp8", "bf16", "tf32", "f32"),
    "fp8": ("fp8", "bf16", "tf32", "f32"),
    "int8": ("int8", "bf16", "tf32", "f32"),
    "bf16": ("bf16", "tf32", "f32"),
    "tf32": ("tf32", "f32"),
    "f32": ("f32",),
}

_CLASS_OF_DTYPE = {
    "f4e2m1fn": "fp4", "f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3": "fp8", "f8e3m4": "fp8",
    "f8e4m3fnuz": "fp8", "f8e5m2fnuz": "fp8", "f8e4m3b11fnuz": "fp8", "s8": "int8",
    "u8": "int8", "bf16": "bf16", "f16": "bf16", "f32": "tf32", "f64": "f32",
}


def rate_class(lhs_dtype: str, rhs_dtype: str) -> str:
    """The rate class of a GEMM from its two operands' HLO element types (the wider one)."""
    classes = [_CLASS_OF_DTYPE.get(d, "f32") for d in (lhs_dtype, rhs_dtype)]
    return max(classes, key=RATE_ORDER.index)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipRates:
    """One chip's published peaks.

    ``matrix_flops``: (rate class, dense FLOP/s) pairs; ``hbm_bytes_per_s``: peak memory
    bandwidth; ``source``: where the figures come from.
    """

    name: str
    description: str
    matrix_flops: tuple[tuple[str, float], ...]
    hbm_bytes_per_s: float
    source: str

    def rate(self, cls: str) -> tuple[float, str]:
        """(FLOP/s, the class charged) for a GEMM of rate class `cls`: the chip's rate for
        it, else that of the first class of ``FALLBACK[cls]`` it has."""
        if cls not in RATE_ORDER:
            raise ValueError(f"rate class: expected one of {RATE_ORDER}, got {cls!r}")
        have = dict(self.matrix_flops)
        for c in FALLBACK[cls]:
            if c in have:
                return have[c], c
        raise ValueError(f"{self.name}: no matrix rate at or above {cls!r}")

    def summary(self) -> str:
        peaks = ", ".join(f"{c} {f / 1e15:.3g} PF" for c, f in self.matrix_flops)
        return (f"{self.name} ({self.description}): {peaks}; HBM "
                f"{self.hbm_bytes_per_s / 1e12:.3g} TB/s. Source: {self.source}")


_NV_HOPPER_SRC = ("NVIDIA H100/H200 Tensor Core GPU datasheets (SXM, dense = half the "
                  "'with sparsity' figures): BF16 989 TFLOPS, FP8 1979 TFLOPS, TF32 494.5, "
                  "INT8 1979 TOPS")

CHIP_RATES: dict[str, ChipRates] = {r.name: r for r in (
    ChipRates(
        name="h100", description="NVIDIA H100 SXM 80GB",
        matrix_flops=(("fp8", 1979e12), ("int8", 1979e12), ("bf16", 989e12),
                      ("tf32", 494.5e12), ("f32", 67e12)),
        hbm_bytes_per_s=3.35e12, source=_NV_HOPPER_SRC + "; HBM3 3.35 TB/s"),
    ChipRates(
        name="h200", description="NVIDIA H200 SXM 141GB",
        matrix_flops=(("fp8", 1979e12), ("int8", 1979e12), ("bf16", 989e12),
                      ("tf32", 494.5e12), ("f32", 67e12)),
        hbm_bytes_per_s=4.8e12, source=_NV_HOPPER_SRC + "; HBM3e 4.8 TB/s (H200 datasheet)"),
    ChipRates(
        name="b200", description="NVIDIA B200 (HGX B200, per GPU)",
        matrix_flops=(("fp4", 9e15), ("fp8", 4.5e15), ("int8", 4.5e15), ("bf16", 2.25e15),
                      ("tf32", 1.1e15)),
        hbm_bytes_per_s=8e12,
        source=("NVIDIA HGX B200 datasheet, per GPU, dense (half the sparse figures): FP4 "
                "9 PF, FP8/FP6 4.5 PF, INT8 4.5 POPS, BF16 2.25 PF, TF32 1.1 PF; HBM3e "
                "8 TB/s")),
    ChipRates(
        name="mi355x", description="AMD Instinct MI355X",
        matrix_flops=(("fp4", 10.1e15), ("fp8", 5.0e15), ("int8", 5.0e15), ("bf16", 2.5e15)),
        hbm_bytes_per_s=8e12,
        source=("AMD Instinct MI355X datasheet, dense: MXFP4 10.1 PF, FP8 5.0 PF, BF16 "
                "2.5 PF; HBM3E 8 TB/s. No deviceless ROCm compile here: listed, not "
                "charged")),
    ChipRates(
        name="v5e", description="Google TPU v5e",
        matrix_flops=(("int8", 394e12), ("bf16", 197e12), ("tf32", 197e12)),
        hbm_bytes_per_s=819e9,
        source=("Google Cloud TPU v5e documentation: 197 TFLOP/s bf16, 394 TOPS int8, "
                "819 GB/s HBM; no FP8 units (f8 dots run as bf16); f32 dots at DEFAULT "
                "precision: one bf16 pass (charged as 'tf32' at the bf16 rate)")),
    ChipRates(
        name="v6e", description="Google TPU v6e (Trillium)",
        matrix_flops=(("int8", 1836e12), ("bf16", 918e12), ("tf32", 918e12)),
        hbm_bytes_per_s=1640e9,
        source=("Google Cloud TPU v6e documentation: 918 TFLOP/s bf16, 1836 TOPS int8, "
                "1640 GB/s HBM; f32 at DEFAULT as on v5e")),
)}


@functools.cache
def rates_for(target: str) -> ChipRates:
    """The rates of a bench/aot.py target name ('h200', 'b200', 'v5e', ...)."""
    try:
        return CHIP_RATES[target]
    except KeyError:
        raise KeyError(f"target: no published rates for {target!r}; known: "
                       f"{sorted(CHIP_RATES)}") from None
