"""bench/ as a toolbox: the cost model's modules import only the ones below them (no
cycle), and nothing in the cost model or the device scripts imports a script."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
# bench/costmodel's modules, lowest first (its __init__ and bench/README.md list them so).
COSTMODEL_ORDER = ("aot", "rates", "hlo_kernels", "ptx_cost", "calibration", "calibrated",
                   "calibration_compile", "tpu_kernel_cycles", "export_shape", "peers",
                   "programs", "accelerator_cost", "targets", "native_fp4", "quantize_cost",
                   "tpu_fusion", "train_memory")


def _bench_imports(path: Path) -> set[str]:
    """The bench.* modules `path` imports anywhere (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "bench" or node.module.startswith("bench.")):
            if node.module in ("bench", "bench.costmodel", "bench.device",
                               "bench.device.sections"):
                out |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("bench.")}
    return out


def _modules(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


def test_every_costmodel_module_has_its_place_in_the_order():
    assert sorted(COSTMODEL_ORDER) == _modules(BENCH / "costmodel")


def test_costmodel_modules_import_only_the_ones_below_them():
    upward = []
    for i, name in enumerate(COSTMODEL_ORDER):
        for imported in _bench_imports(BENCH / "costmodel" / f"{name}.py"):
            parts = imported.split(".")
            if parts[:2] != ["bench", "costmodel"]:
                upward.append(f"{name} -> {imported} (outside the cost model)")
            elif len(parts) > 2 and parts[2] in COSTMODEL_ORDER[i:]:
                upward.append(f"{name} -> {imported}")
    assert not upward, ("bench/costmodel imports must point down COSTMODEL_ORDER: "
                        f"{upward}")


def test_device_scripts_import_the_cost_model_and_their_harness_only():
    scripts = {f"bench.{m}" for m in _modules(BENCH)}
    bad = []
    for path in sorted((BENCH / "device").rglob("*.py")):
        for imported in _bench_imports(path):
            if imported in scripts or not imported.startswith(("bench.costmodel",
                                                               "bench.device")):
                bad.append(f"{path.relative_to(BENCH)} -> {imported}")
    assert not bad, bad


def test_the_readme_names_every_script():
    readme = (BENCH / "README.md").read_text()
    missing = [m for m in _modules(BENCH) if f"`{m}.py`" not in readme]
    missing += [m for m in COSTMODEL_ORDER if f"`{m}`" not in readme]
    assert not missing, f"bench/README.md does not say what these answer: {missing}"
