"""The measurements file: every entry has its provenance, the loader rejects a malformed
file with a message naming the entry, and AUTO_CHOICES' evidence is in it and supports
each choice."""

from __future__ import annotations

import json
import re

import pytest

from mxjax import measurements as M


def test_every_figure_and_rate_has_its_provenance():
    data = M.load()
    assert data.figures and data.chip_rates
    for fig in data.figures:
        p = fig.provenance
        assert fig.kind in M.FIGURE_KINDS
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", p.date), fig.key
        assert re.fullmatch(r"[0-9a-f]{40}", p.commit), fig.key
        if fig.kind in ("measured", "estimated"):
            assert p.chip and p.jax and p.command and fig.unit and fig.values, fig.key
    for rates in data.chip_rates:
        assert rates.source and rates.hbm_bytes_per_s > 0
        assert dict(rates.matrix_flops)["bf16"] > 0


def test_the_packaged_file_is_the_one_module_functions_read():
    assert M.chip_rates("h200") == M.load().rates("h200")
    assert M.figure("layer_8b.h200.measured").unit == "ms"
    assert {r.name for r in M.all_chip_rates()} >= {"h100", "h200", "b200", "v5e"}


def test_unknown_keys_name_the_known_ones():
    with pytest.raises(M.MeasurementsError, match="known: .*h200"):
        M.chip_rates("h9000")
    with pytest.raises(M.MeasurementsError, match="no figure 'nope'"):
        M.figure("nope")
    with pytest.raises(KeyError, match="no value 'nope'"):
        M.figure("layer_8b.h200.measured").value("nope")


def _doc():
    return json.loads(M.resources.files("mxjax").joinpath("measurements.json").read_text())


@pytest.mark.parametrize("breakage,message", [
    (lambda d: d["figures"][0].pop("provenance"), r"figures\[0\]: .*missing \['provenance'\]"),
    (lambda d: d["figures"][1]["values"].update(bf16="fast"),
     r"figures\[1\].*bf16: expected a number"),
    (lambda d: d["figures"][0].update(kind="guessed"), r"kind: expected one of"),
    (lambda d: d["chip_rates"][0]["provenance"].update(source=""), r"need their source"),
    (lambda d: d["figures"].append(d["figures"][0]), r"figures named more than once"),
    (lambda d: d.update(schema=2), r'"schema": 1'),
])
def test_a_malformed_file_names_the_file_and_entry(tmp_path, breakage, message):
    doc = _doc()
    breakage(doc)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(M.MeasurementsError, match=message) as err:
        M.load(path)
    assert str(path) in str(err.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(M.MeasurementsError, match="cannot read"):
        M.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(M.MeasurementsError, match="not valid JSON"):
        M.load(tmp_path / "bad.json")
