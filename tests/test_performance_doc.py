"""docs/PERFORMANCE.md quotes the figures of mxjax/measurements.json as the file has them,
and says where each comes from (chip, date, jax, commit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxjax import measurements

PAGE = Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md"
# The data file's figures that the page quotes.
QUOTED = ("layer_8b.h200.measured", "layer_8b.h200.rates_roofline",
          "layer_8b.b200.rates_roofline", "layer_8b.b200.triton_rates_roofline",
          "gemm_8192.h200.measured", "layer_8b.h200.calibrated", "layer_8b.b200.calibrated")
# A guide (how to measure, today's figures, what to run on which chip); history goes to
# docs/CHANGELOG.md.
MAX_LINES = 250


def test_the_page_is_a_guide_of_bounded_length():
    n = len(PAGE.read_text().splitlines())
    assert n <= MAX_LINES, (
        f"docs/PERFORMANCE.md has {n} lines (at most {MAX_LINES}): move superseded figures "
        "and their before/after to docs/CHANGELOG.md")


@pytest.mark.parametrize("key", QUOTED)
def test_the_page_quotes_the_figure_and_its_provenance(key):
    text = PAGE.read_text()
    fig = measurements.figure(key)
    absent = [f"{label} {v:g}" for label, v in fig.values
              if f"{v:.2f}" not in text and f"{v:g}" not in text]
    assert not absent, f"docs/PERFORMANCE.md does not quote {key}'s {absent}"
    p = fig.provenance
    assert p.date in text and p.jax in text and p.commit[:7] in text, (key, p)


def test_on_your_chip_is_written_from_the_data_file():
    # A figure changed in mxjax/measurements.json fails here until the section is rewritten:
    # python scripts/on_your_chip.py --write
    from scripts import on_your_chip

    section = on_your_chip.section_in_page(PAGE.read_text())
    assert section is not None, "docs/PERFORMANCE.md lost its on-your-chip markers"
    assert section == on_your_chip.render(), "run: python scripts/on_your_chip.py --write"
    assert PAGE.read_text().index(on_your_chip.BEGIN) < PAGE.read_text().index("\n## ")


def test_on_your_chip_ratios_are_the_files():
    from scripts import on_your_chip

    text = on_your_chip.render()
    est = measurements.figure("layer_8b.b200.rates_roofline")
    assert f"{est.value('xla_fp4') / est.value('bf16'):.2f}x bf16" in text
    run = measurements.figure("layer_8b.h200.measured")
    assert f"{run.value('xla_fp8') / run.value('bf16'):.2f}x bf16" in text
    assert "`xla_fp4`, MXFP4 re-encoded" in text and "`xla_fp8`, MXFP4 carried" in text
