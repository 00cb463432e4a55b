"""bench.costmodel.tpu_fusion: the kernel with and without XLA's input fusion of its convert.

Run in a subprocess (libtpu reads the profile flag when it starts). For blocks along
lanes the fused kernel is one op and cheaper than the separate convert plus kernel
(the figures in docs/PERFORMANCE.md); the separate form really has two ops.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators

ROOT = Path(__file__).resolve().parents[2]
_ROWS = """
import json
from bench.costmodel import tpu_fusion
rows = tpu_fusion.fusion_rows(lanes=True)
print(json.dumps({r.form: [r.total_us, sorted(r.op_us)] for r in rows}))
"""


def test_probe_lanes_fusion_is_one_op_and_saves_the_convert():
    require("v5e")
    proc = subprocess.run([sys.executable, "-c", _ROWS], capture_output=True, text=True,
                          check=False, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.splitlines()[-1])
    assert set(rows) == {"bf16 in", "convert + kernel", "convert fused", "f32 in"}, rows
    assert all(total > 0 for total, _ in rows.values())
    separate_s, separate_ops = rows["convert + kernel"]
    fused_s, fused_ops = rows["convert fused"]
    assert len(separate_ops) == 2 and any(o.startswith("convert") for o in separate_ops)
    assert len(fused_ops) == 1
    assert fused_s < separate_s, rows
    # the kernel that rounds the f32 weight itself (what the layer runs) is one op and
    # cheaper than the separate convert plus kernel
    f32_s, f32_ops = rows["f32 in"]
    assert len(f32_ops) == 1 and f32_s < separate_s, rows
