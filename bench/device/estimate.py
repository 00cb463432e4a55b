"""The cost model's estimate per kernel class, printed beside the measured profile.

`model_estimate_us` is the one call into `bench.costmodel` that the device profile makes:
repoint it (and only it) when the calibrated model lands. Today it charges each kernel of
the compiled program at the published peak rates of its chip (`bench.costmodel.rates`, the
rates roofline of `bench.costmodel.accelerator_cost`: GEMM flops at the operand class's rate
or its bytes at the HBM bandwidth, whichever is longer, plus one launch), grouped into the
classes `bench.device.trace.hlo_classes` gives the measured kernels.
"""

from __future__ import annotations

from bench.device.trace import hlo_classes

__all__ = ["MODEL_NAME", "chip_name", "model_estimate_us"]

MODEL_NAME = "rates roofline (published peaks)"
_CHIPS = (("gb200", "b200"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"))


def chip_name(device_kind: str) -> str | None:
    """The cost model's chip name ('h100', 'h200', 'b200') of a jax device_kind, or None."""
    kind = device_kind.lower().replace(" ", "")
    return next((name for key, name in _CHIPS if key in kind), None)


def model_estimate_us(hlo_text: str, chip: str | None) -> dict[str, float]:
    """Estimated microseconds per kernel class of one call of the compiled program whose
    optimized HLO is `hlo_text`, on `chip` (a `bench.costmodel.aot` target name); {} where
    the model has no rates for the chip (a CPU, an unknown GPU)."""
    from bench.costmodel import accelerator_cost, aot
    from bench.costmodel import hlo_kernels as hk

    if chip is None or chip not in ("h100", "h200", "b200"):
        return {}
    target = aot.TARGETS[chip]
    classes = hlo_classes(hlo_text)
    out: dict[str, float] = {}
    for k in hk.kernels(hlo_text):
        cls = classes.get(k.name, "other")
        out[cls] = out.get(cls, 0.0) + accelerator_cost.rates_roofline([k], target) * 1e6
    return out
