"""The cost model's estimate per kernel class, printed beside the measured profile.

`model_estimate_us` is the one call into `bench.costmodel` that the device profile makes.
It charges each kernel of the compiled program at the calibrated rates of its chip
(`bench.costmodel.calibrated`: GEMMs at the measured fraction of their class's peak,
fusions by their PTX instructions at the measured issue rate, Triton kernels by their SASS
and occupancy or their spills, every kernel at least its bytes at the measured copy
bandwidth, plus a launch), grouped into the classes `bench.device.trace.hlo_classes` gives
the measured kernels. The fusions' and Triton kernels' instruction counts come from the
compile's XLA dump (``dump``, compiled with `bench.costmodel.ptx_cost.dump_options`) or
from committed counts (``counts``); without either (a GEMM-only check) those kernels are
charged by their bytes alone.
"""

from __future__ import annotations

from pathlib import Path

from bench.device.trace import hlo_classes

__all__ = ["MODEL_NAME", "chip_name", "model_estimate_us"]

MODEL_NAME = "calibrated (bench/costmodel/calibrated.py)"
_CHIPS = (("gb200", "b200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"))
MODEL_CHIPS = ("h100", "h200", "b200")


def chip_name(device_kind: str) -> str | None:
    """The cost model's chip name ('h100', 'h200', 'b200') of a jax device_kind, or None."""
    kind = device_kind.lower().replace(" ", "")
    return next((name for key, name in _CHIPS if key in kind), None)


def model_estimate_us(hlo_text: str, chip: str | None, *, dump: Path | str | None = None,
                      counts=None) -> dict[str, float]:
    """Estimated microseconds per kernel class of one call of the compiled program whose
    optimized HLO is `hlo_text`, on `chip` (a `bench.costmodel.aot` target name), at the
    chip's calibrated rates; {} where the model has no rates for the chip (a CPU, an
    unknown GPU). ``dump``: the compile's XLA dump directory; ``counts``: a
    `bench.costmodel.calibrated.Counts` (give one or neither)."""
    from bench.costmodel import calibrated
    from bench.costmodel import hlo_kernels as hk

    if chip is None or chip not in MODEL_CHIPS:
        return {}
    if dump is not None and counts is not None:
        raise ValueError("model_estimate_us: give the XLA dump or the counts, not both")
    if dump is not None:
        counts = calibrated.counts_from_dump(hlo_text, Path(dump))
    if counts is None:
        counts = calibrated.Counts(fusion_instructions={}, triton={})
    rates = calibrated.rates_for(chip)
    classes = hlo_classes(hlo_text)
    out: dict[str, float] = {}
    for k in hk.kernels(hlo_text):
        cls = classes.get(k.name, "other")
        out[cls] = out.get(cls, 0.0) + calibrated.kernel_seconds(k, counts, rates) * 1e6
    return out
