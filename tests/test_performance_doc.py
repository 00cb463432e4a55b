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


@pytest.mark.parametrize("key", QUOTED)
def test_the_page_quotes_the_figure_and_its_provenance(key):
    text = PAGE.read_text()
    fig = measurements.figure(key)
    absent = [f"{label} {v:g}" for label, v in fig.values
              if f"{v:.2f}" not in text and f"{v:g}" not in text]
    assert not absent, f"docs/PERFORMANCE.md does not quote {key}'s {absent}"
    p = fig.provenance
    assert p.date in text and p.jax in text and p.commit[:7] in text, (key, p)
