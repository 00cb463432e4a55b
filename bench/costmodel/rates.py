"""Peak rates per chip that the rates roofline (bench/costmodel/accelerator_cost.py) charges
kernels at, read from the package's data file (``mxjax/measurements.json``, loaded by
`mxjax.measurements`: each chip's published figures with their source and provenance).

Every figure is a vendor's published dense (no 2:4 sparsity) peak: matrix rates per
operand type in FLOP/s and memory bandwidth in bytes/s; the per-kernel launch cost is
the file's ``assumption.kernel_launch_s``. They are assumptions, not measurements: no
chip reaches them, and the roofline states that wherever it prints a time. A rate that a
chip lacks is absent: a GEMM of that operand type runs on the units of the next wider
type that the chip has (:meth:`ChipRates.rate`; FP8 on an H200 runs FP8, FP4 on an H200
runs at its FP8 rate at best and mxjax's Hopper paths upcast to bf16: the roofline
charges what the compiled program's operand types say).

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

def _launch_s() -> float:
    from mxjax import measurements

    return measurements.figure("assumption.kernel_launch_s").value("launch")


LAUNCH_S = _launch_s()  # per kernel launch (GPU) or per fusion/custom call (TPU)

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
    """One chip's published peaks (from the data file), with the fallback between classes.

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


def _from_data_file() -> dict[str, ChipRates]:
    from mxjax import measurements

    return {r.name: ChipRates(name=r.name, description=r.description,
                              matrix_flops=r.matrix_flops, hbm_bytes_per_s=r.hbm_bytes_per_s,
                              source=r.source)
            for r in measurements.all_chip_rates()}


CHIP_RATES: dict[str, ChipRates] = _from_data_file()


@functools.cache
def rates_for(target: str) -> ChipRates:
    """The rates of a bench/costmodel/aot.py target name ('h200', 'b200', 'v5e', ...)."""
    try:
        return CHIP_RATES[target]
    except KeyError:
        raise KeyError(f"target: no published rates for {target!r}; known: "
                       f"{sorted(CHIP_RATES)}") from None
