"""Data flows one way inside mxjax: every import (module-level and inside functions) follows LAYERS.

The graph is read from the source with `ast`, so an import hidden in a function
body counts like one at the top of the module. Also checked: no module imports
another module's private name, and `import mxjax` pulls in neither Flax nor
Pallas (the reason the interceptor imports `mxjax.kernels` lazily).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "mxjax"

# Lowest first. A module may import modules of its own unit (a package such as
# mxjax.kernels) and of units in earlier layers, never later ones; units that
# share a layer do not import each other.
#  - the quantizer is built bottom up: element grids (elements), the scaling
#    schemes (scaling), the validated OperandRecipe the quantizer takes
#    (operand_recipe; mxjax.recipes re-exports it), then quantization.
#  - kernels sit above recipes (they take the backend names from mxjax.recipes)
#    and below mxjax.gemm (one GEMM under a recipe), their only caller, which
#    imports them lazily so that `import mxjax` stays free of Pallas.
#  - the interceptor (the custom_vjp over the three GEMMs) sits above mxjax.gemm.
#  - policies sit above the interceptor: PrecisionPolicy.dot_general and
#    mxjax.dot_general run it; the interceptor reads a policy through the
#    mxjax.recipes.PolicyRecipes protocol and never imports the policy type.
#  - diagnostics sit above the interceptor and plug into it through its one
#    hook, mxjax.interceptor.observe.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("formats", "layout", "validation", "_platform", "dimensions"),
    ("_bits",),
    ("elements",),
    ("scaling",),
    ("operand_recipe",),
    ("quantization", "rotation"),
    ("recipes",),
    ("kernels",),
    ("gemm",),
    ("interceptor",),
    ("policies",),
    ("diagnostics",),
    ("nn",),
    ("testing",),
)
FACADE = "mxjax"  # mxjax/__init__.py: re-exports from any layer; nothing imports it


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _unit(module: str) -> str:
    """'mxjax.kernels.dispatch' -> 'kernels'; 'mxjax' -> the facade."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _is_module(name: str) -> bool:
    return name in MODULES


def _imports(module: str) -> list[tuple[str, int, str | None]]:
    """(imported mxjax module, line, imported name or None) for every import in `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "mxjax" or alias.name.startswith("mxjax."):
                    out.append((alias.name, node.lineno, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != "mxjax" and not source.startswith("mxjax."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if _is_module(sub):  # `from mxjax import formats`: an edge to the submodule
                    out.append((sub, node.lineno, None))
                else:
                    out.append((source, node.lineno, alias.name))
    return out


def _edges():
    return {m: _imports(m) for m in MODULES}


def test_layers_name_every_unit():
    units = {_unit(m) for m in MODULES} - {FACADE}
    assert units <= set(LAYER_OF), f"add {sorted(units - set(LAYER_OF))} to LAYERS"


def test_imports_follow_the_layer_order():
    bad = []
    for module, imports in _edges().items():
        src = _unit(module)
        for target, line, _ in imports:
            dst = _unit(target)
            where = f"{_rel(MODULES[module])}:{line}: {module} -> {target}"
            if dst == FACADE:
                if src != FACADE:
                    bad.append(f"{where} (the package facade is above every layer)")
            elif src == FACADE or src == dst:
                continue
            elif LAYER_OF[dst] >= LAYER_OF[src]:
                bad.append(f"{where} ({src} is in layer {LAYER_OF[src]}, {dst} in "
                           f"{LAYER_OF[dst]})")
    assert not bad, "imports against the declared order:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    graph = {m: sorted({t for t, _, _ in imps if t != m and t in MODULES})
             for m, imps in _edges().items()}
    # A package's __init__ re-exports its submodules: those edges point downward by design.
    graph = {m: [t for t in ts if not t.startswith(m + ".")] for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_imports_another_modules_private_names():
    bad = []
    for module, imports in _edges().items():
        for target, line, name in imports:
            where = f"{_rel(MODULES[module])}:{line}"
            if name is not None and name.startswith("_"):
                bad.append(f"{where}: {module} imports {target}.{name}")
            private_parts = [p for p in target.split(".") if p.startswith("_")]
            if private_parts:
                owner = target.rpartition(".")[0]  # a private module is private to its package
                if not (module == owner or module.startswith(owner + ".")):
                    bad.append(f"{where}: {module} imports {target}")
        tree = ast.parse(MODULES[module].read_text())
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("mxjax") for a in n.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                    and _is_module(_resolve_alias(tree, node.value.id) or "")):
                bad.append(f"{_rel(MODULES[module])}:{node.lineno}: {module} uses "
                           f"{node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _resolve_alias(tree: ast.Module, alias: str) -> str | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mxjax"):
            for a in node.names:
                if (a.asname or a.name) == alias:
                    return f"{node.module}.{a.name}"
    return None


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The walker finds an import inside a function body and resolves relative imports."""
    src = ("def f():\n    from mxjax import nn\n    from mxjax.quantization import _core\n"
           "from . import formats\n")
    (tmp_path / "recipes.py").write_text(src)
    monkeypatch.setitem(MODULES, "mxjax.recipes", tmp_path / "recipes.py")
    found = _imports("mxjax.recipes")
    assert ("mxjax.nn", 2, None) in found
    assert ("mxjax.quantization", 3, "_core") in found
    assert ("mxjax.formats", 4, None) in found
    with pytest.raises(AssertionError, match="recipes -> mxjax.nn"):
        test_imports_follow_the_layer_order()
    with pytest.raises(AssertionError, match="_core"):
        test_no_module_imports_another_modules_private_names()


def test_import_mxjax_loads_neither_flax_nor_pallas():
    code = ("import sys, mxjax\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'flax' "
            "or m.startswith('jax.experimental.pallas') or m.startswith('mxjax.kernels') "
            "or m.startswith('mxjax.nn')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
