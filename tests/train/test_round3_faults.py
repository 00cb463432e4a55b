"""Reliability round 3 (issue 45, items 9-12 and the non-data UNCLEAR items): what a careless
user or an operator does to a run, each answered by a message that says what to do."""

from __future__ import annotations

import pytest

from tests.train.data.stream_testutil import grain_sets, write_shards
from tests.train.train_testutil import ROOT, fast_sets, load
from train import loop
from train.__main__ import main
from train.config import ConfigError

FIXTURE = ROOT / "tests" / "models" / "data" / "hf_tiny_llama"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("c4"), n_shards=2)


def test_init_from_architecture_is_checked_under_grain(shards, data_cache, tmp_path, capsys):
    """Item 9: the grain loader checks model.init_from's architecture as the prepared loader
    does (at --check and at start), naming each differing field; exit 2."""
    cfg = load(tmp_path / "g", data_cache, f"model.init_from={FIXTURE}", *grain_sets(shards))
    with pytest.raises(ConfigError, match="model.init_from") as e:
        loop.validate(cfg, verbose=False)
    assert "rope_theta: checkpoint 10000.0, run 500000.0" in str(e.value)
    capsys.readouterr()
    sets = [*fast_sets(tmp_path / "g", data_cache), f"model.init_from={FIXTURE}",
            *grain_sets(shards)]
    rc = main(["--check", *[f"--set={s}" for s in sets]])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: model.init_from"), err
    assert "Traceback" not in err
