"""bench/fsdp_gathers.py's reading of an optimized HLO module: every all-gather's result
bytes (sync and async forms, sub-byte dtypes), the vocabulary's gathers left out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "fsdp_gathers.py"


@pytest.fixture(scope="module")
def fsdp_gathers():
    spec = importlib.util.spec_from_file_location("fsdp_gathers", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HLO = """
  %all-gather.1 = bf16[4096,14336]{1,0} all-gather(bf16[512,14336]{1,0} %p), dimensions={0}
  %ags.2 = (u8[512,7168]{1,0}, u8[4096,7168]{1,0}) all-gather-start(u8[512,7168]{1,0} %c)
  %agd.2 = u8[4096,7168]{1,0} all-gather-done(%ags.2)
  ROOT %all-gather.3 = f4e2m1fn[64,32]{1,0} all-gather(f4e2m1fn[8,32]{1,0} %e), dimensions={0}
  %all-gather.4 = bf16[128256,4096]{1,0} all-gather(bf16[16032,4096]{1,0} %w), dimensions={0}
  %add.5 = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)
"""


def test_every_gather_is_counted_once_by_its_result(fsdp_gathers):
    rows = fsdp_gathers.gathers(HLO)
    assert [b for _, b in rows] == [4096 * 14336 * 2, 4096 * 7168, 64 * 32 * 0.5,
                                    128256 * 4096 * 2]
    assert rows[1][0] == "u8[4096,7168]"  # an async start's result, not its operand


def test_the_vocabulary_gathers_are_left_out(fsdp_gathers):
    rows = fsdp_gathers.gathers(HLO, skip_dim=128256)
    assert len(rows) == 3 and all("128256" not in shape for shape, _ in rows)
