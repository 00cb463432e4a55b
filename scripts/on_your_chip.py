"""The "On your chip" section of docs/PERFORMANCE.md, written from mxjax/measurements.json.

What backend 'auto' (the training default) runs on each class of chip
(`mxjax.backends.AUTO_CHOICES`) and the Llama 3.1-8B layer's figures to expect there,
each ratio computed from the data file's values, with their kind and provenance. The page
holds this text between the two markers below; ``tests/test_performance_doc.py`` checks
that it equals what this script writes, so a changed figure in the data file fails until
the page is regenerated::

    python scripts/on_your_chip.py            # print the section
    python scripts/on_your_chip.py --write    # replace it in docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from mxjax import measurements
from mxjax.backends import auto_backend, capabilities_for
from mxjax.chips import Chip

PAGE = ROOT / "docs" / "PERFORMANCE.md"
BEGIN = "<!-- on-your-chip: written by scripts/on_your_chip.py from mxjax/measurements.json -->"
END = "<!-- /on-your-chip -->"

# One representative chip per row, for the 'auto' column (AUTO_CHOICES decides).
_CHIPS = {
    "cpu": Chip(platform="cpu", device_kind="cpu"),
    "h200": Chip(platform="gpu", device_kind="NVIDIA H200", compute_capability=(9, 0)),
    "b200": Chip(platform="gpu", device_kind="NVIDIA B200", compute_capability=(10, 0)),
    "tpu": Chip(platform="tpu", device_kind="TPU v5 lite"),
}
_WHAT = {
    "xla": "the emulation",
    "xla_fp8": "MXFP4 carried exactly in FP8 on the FP8 tensor cores",
    "xla_fp4": "MXFP4 re-encoded exactly for cuDNN's FP4 MMA",
}


def _ratio(fig: measurements.Figure, label: str, over: str) -> str:
    return f"{fig.value(label) / fig.value(over):.2f}x"


def _source(fig: measurements.Figure) -> str:
    p = fig.provenance
    roofline = fig.key.endswith("rates_roofline")
    bound = ", peak roofline (upper bound)" if roofline else ""
    return (f"{fig.kind}{bound}, `{fig.key}` ({p.chip.upper()}, {p.date}, jax {p.jax}, "
            f"{p.commit[:7]})")


def _gpu_row(chip: str, backend: str, fig: measurements.Figure) -> str:
    return (f"{_ratio(fig, backend, 'bf16')} bf16 ({fig.value(backend):g} against "
            f"{fig.value('bf16'):g} {fig.unit}), {_ratio(fig, backend, 'xla')} the emulation; "
            f"`fp8` {_ratio(fig, 'fp8', 'bf16')} bf16 | {_source(fig)}")


def _calibrated_row(chip: str, fig: measurements.Figure) -> str:
    measured = ", ".join(f"`{label}` {_ratio(fig, label, 'bf16')} bf16"
                         for label, _ in fig.values if label != "bf16")
    rates = ("the H200 run's measured rates" if chip == "H200" else
             "the H200's measured fractions of the B200's peaks")
    return (f"| {chip}, calibrated | the peak roofline's kernels at {rates} "
            f"| {measured or 'bf16 alone so far'} | {_source(fig)} |")


def render() -> str:
    """The section's text (between the markers), from the packaged data file."""
    auto = {k: auto_backend(capabilities_for(c)) for k, c in _CHIPS.items()}
    h200_est = measurements.figure("layer_8b.h200.rates_roofline")
    h200_run = measurements.figure("layer_8b.h200.measured")
    b200_est = measurements.figure("layer_8b.b200.rates_roofline")
    lines = [
        BEGIN,
        "## On your chip",
        "",
        "Training's `backend: auto` (the default) runs each quantized GEMM on the chip's fastest",
        "exact route and logs it (`routes` in summary.json). Figures: the Llama 3.1-8B layer's",
        "train step (seq 8192, fused attention), `mxfp4_all_h16` against bf16 on the same chip,",
        "written from `mxjax/measurements.json` by `scripts/on_your_chip.py`.",
        "",
        "| chip | `auto` runs | expect | kind and source |",
        "|---|---|---|---|",
        (f"| CPU | `{auto['cpu']}`, {_WHAT[auto['cpu']]} (bit for bit the reference) | the "
         "tiny config's step 1.1–1.2x no policy ([CPU](#cpu)) | measured, 2 cores; "
         "not in the data file |"),
        (f"| H100, H200 | `{auto['h200']}`, {_WHAT[auto['h200']]} | "
         f"{_gpu_row('h200', auto['h200'], h200_est)} |"),
        (f"| H200, run | the same route, measured before the fused quantize passes | "
         f"{_gpu_row('h200', auto['h200'], h200_run)} |"),
        _calibrated_row("H200", measurements.figure("layer_8b.h200.calibrated")),
        (f"| B200, GB200 | `{auto['b200']}`, {_WHAT[auto['b200']]} | "
         f"{_gpu_row('b200', auto['b200'], b200_est)}; never run on a B200 |"),
        _calibrated_row("B200", measurements.figure("layer_8b.b200.calibrated")),
        (f"| TPU v5e, v6e | `{auto['tpu']}`, {_WHAT[auto['tpu']]} (Pallas TPU quantize "
         "kernels) | 1B layer 1.27x bf16 ([below](#the-emulation-on-gpus-and-tpus-1b-layer)) "
         "| estimated (`optimal_seconds`, v5e); not in the data file |"),
        "",
        "*Exact*: the emulation's quantized operands, bit for bit, summed by the chip's GEMM (the",
        "[NUMERICS.md](NUMERICS.md#mxfp4-on-fp8-and-fp4-matrix-units-the-xla_fp8-and-xla_fp4-backends)",
        "bound). The H100 takes the H200's figures until measured. A backend that cannot run on",
        "the chip raises; one without a speed-up there (`xla_fp8` on a CPU) is refused by the",
        "training CLI ([TRAINING.md](TRAINING.md#on-a-chips-fp8-and-fp4-units)).",
        END,
    ]
    return "\n".join(lines)


def section_in_page(text: str) -> str | None:
    """The section as the page holds it (markers included), or None without markers."""
    if BEGIN not in text or END not in text:
        return None
    start = text.index(BEGIN)
    return text[start:text.index(END, start) + len(END)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"replace the section in {PAGE}")
    args = ap.parse_args(argv)
    new = render()
    if not args.write:
        print(new)
        return 0
    text = PAGE.read_text()
    old = section_in_page(text)
    if old is None:
        print(f"{PAGE}: no {BEGIN!r} ... {END!r} markers; add them where the section goes",
              file=sys.stderr)
        return 2
    PAGE.write_text(text.replace(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
