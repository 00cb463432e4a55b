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


BRANCHED = """
HloModule m

%inner (p: bf16[512,4096]) -> bf16[4096,4096] {
  ROOT %all-gather.9 = bf16[4096,4096]{1,0} all-gather(bf16[512,4096]{1,0} %p), dimensions={0}
}

%region_0.1 (x.0: (bf16[512,4096])) -> (bf16[4096,4096]) {
  %all-gather.2 = bf16[4096,14336]{1,0} all-gather(bf16[512,14336]{1,0} %q), dimensions={0}
  %f = bf16[4096,4096]{1,0} fusion(%x), kind=kLoop, calls=%inner
}

%region_1.2 (x.1: (bf16[512,4096])) -> (bf16[4096,4096]) {
  %all-gather.3 = u8[4096,7168]{1,0} all-gather(u8[512,7168]{1,0} %c), dimensions={0}
  %c2 = (f32[8]{0}) conditional(%i, %t, %t), true_computation=%inner_exact, \
false_computation=%inner_fb
}

%inner_exact (p: u8[8,32]) -> u8[64,32] {
  ROOT %all-gather.4 = u8[64,32]{1,0} all-gather(u8[8,32]{1,0} %p), dimensions={0}
}

%inner_fb (p: bf16[256,2048]) -> bf16[2048,2048] {
  ROOT %all-gather.6 = bf16[2048,2048]{1,0} all-gather(bf16[256,2048]{1,0} %p), dimensions={0}
}

%body (p: u8[8,32]) -> u8[64,32] {
  ROOT %all-gather.5 = u8[64,16]{1,0} all-gather(u8[8,16]{1,0} %p), dimensions={0}
}

ENTRY %main.3 (p.1: pred[], x.5: f32[8]) -> f32[8] {
  %all-gather.1 = bf16[4096,1024]{1,0} all-gather(bf16[512,1024]{1,0} %p), dimensions={0}
  %cond.1 = (f32[8]{0}) conditional(%i, %t, %t), branch_computations={%region_0.1, %region_1.2}
  %w = (f32[8]{0}) while(%t), condition=%cnd, body=%body
}
"""


def test_gathers_are_split_by_the_branch_that_runs_them(fsdp_gathers):
    """Outside conditionals a step always gathers; in a conditional's last (true) branch
    when the scale windows are exact; in its others (and everything they call, a nested
    conditional's exact branch included) only on the emulation fallback."""
    paths = fsdp_gathers.gathers_by_path(BRANCHED)
    shapes = {path: sorted(shape for shape, _ in rows) for path, rows in paths.items()}
    assert shapes == {
        "always": ["bf16[4096,1024]", "u8[64,16]"],
        "exact": ["u8[4096,7168]", "u8[64,32]"],
        "fallback": ["bf16[2048,2048]", "bf16[4096,14336]", "bf16[4096,4096]"],
    }
    assert sum(len(v) for v in paths.values()) == len(fsdp_gathers.gathers(BRANCHED))
    with pytest.raises(ValueError, match="no ENTRY"):
        fsdp_gathers.gathers_by_path("%all-gather.1 = u8[8]{0} all-gather(u8[1]{0} %p)")
