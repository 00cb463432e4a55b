"""Data flows one way: every import (module-level and inside functions) follows the layers.

Between packages: ``mxjax -> models -> train -> study`` (`PACKAGES`, lowest first):
the library imports none of the others, the model never imports the loop or the
study, the loop never imports the study. Inside a package (and inside the
subpackages listed in `LAYERS`), its units (modules or subpackages) follow the
package's own order.

The graph is read from the source with `ast`, so an import hidden in a function
body counts like one at the top of the module. Also checked: no module imports
another module's private name, no import cycles between modules, and `import
mxjax` pulls in neither Flax nor Pallas (the reason the interceptor imports
`mxjax.kernels` lazily).
"""

from __future__ import annotations

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first: a package imports only packages before it.
PACKAGES: tuple[str, ...] = ("mxjax", "models", "train", "study")

# Per package, lowest first. A module may import modules of its own unit (a module, or a
# subpackage: its own order is checked where LAYERS names it) and of units in earlier
# layers, never later ones; units that share a layer do not import each other. A package's
# facade (its __init__) may re-export any unit; inside the package only `__main__` imports it.
LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    #  - the quantizer is built bottom up: element grids (elements), the scaling
    #    schemes (scaling), the validated OperandRecipe the quantizer takes
    #    (operand_recipe; mxjax.recipes re-exports it), then quantization; beside the
    #    schemes, MXFP4 values by integer rounding of the bit pattern (e2m1_bits), the
    #    path fake_quantize takes for deterministic MXFP4.
    #  - the backends, bottom up: the chip compiled for (chips) and the measurements file
    #    (measurements) need nothing of mxjax; one GEMM's canonical, rotated operands
    #    (operands); the emulation and its platform forms (emulation, backend 'xla');
    #    mxjax's own kernels (kernels: the fused quantizer, the Triton GEMM, the exact
    #    reference), which the routes import lazily so that `import mxjax` stays free of
    #    them; one module per route (routes, their own order LAYERS["mxjax.routes"]);
    #    the registry that chooses among them (backends); then the recipes, which take
    #    their backend names from the registry, and mxjax.gemm, which runs the chosen
    #    route. Nothing below the registry knows the backend names.
    #  - the interceptor (the custom_vjp over the three GEMMs) sits above mxjax.gemm,
    #    mxjax.residuals (the backward's operands quantized and packed by the forward) and
    #    mxjax.gemm_record (the GemmRecord it hands observers of each GEMM); the remat
    #    policies (remat) need nothing of mxjax. Beside mxjax.gemm, shard_blocks: whether
    #    a mesh keeps each quantization block on one device (formats and recipes).
    #  - policies sit above the interceptor: PrecisionPolicy.dot_general and
    #    mxjax.dot_general run it; the interceptor reads a policy through the
    #    mxjax.recipes.PolicyRecipes protocol and never imports the policy type.
    #  - diagnostics sit above the interceptor and plug into it through its one
    #    hook, mxjax.interceptor.observe.
    "mxjax": (
        ("formats", "layout", "validation", "_platform", "dimensions", "measurements", "chips",
         "remat"),
        ("_bits",),
        ("elements",),
        ("scaling", "e2m1_bits"),
        ("operand_recipe",),
        ("quantization", "rotation"),
        ("operands",),
        ("emulation",),
        ("kernels",),
        ("routes",),
        ("backends",),
        ("recipes",),
        ("gemm", "residuals", "shard_blocks"),
        ("gemm_record",),
        ("interceptor",),
        ("policies",),
        ("diagnostics",),
        ("nn",),
        ("testing",),
    ),
    #  - the emulation's f32 values (in_place_values), its TPU kernel (in_place_tpu), then
    #    its GPU form (in_place); beside it FP8 recipes on FP8 units (fp8_units); the
    #    emulated GEMM over all of them (forms).
    "mxjax.emulation": (
        ("in_place_values", "f8_accumulation"),
        ("in_place_tpu",),
        ("in_place", "fp8_units"),
        ("forms",),
    ),
    #  - the policy type (policy) above the deprecated names (aliases); the presets and the
    #    dict form build on the type; the lookup (get, resolve) on all of them.
    "mxjax.policies": (
        ("aliases", "policy"),
        ("presets", "dict_form"),
        ("lookup",),
    ),
    #  - what a route declares (spec); the routes: the emulation ('xla'), 'triton', and
    #    the MXFP4 routes over the emulation's in-place operands: 'xla_fp8' (carried in
    #    FP8), then 'xla_fp4' (NVFP4, sharing xla_fp8's window and result scaling; its
    #    operand kernel below it); the one-pass NVFP4/MXFP8 operand kernels on the
    #    generic kernel of xla_fp4_kernel; 'xla_nvfp4' and 'xla_mxfp8' on xla_fp4's
    #    operand views. threefry (jax.random's draws at given indices) below the kernels.
    "mxjax.routes": (
        ("spec", "threefry"),
        ("xla_fp4_kernel",),
        ("xla", "triton", "xla_fp8", "xla_nvfp4_kernel", "xla_mxfp8_kernel"),
        ("xla_fp4",),
        ("xla_nvfp4",),
        ("xla_mxfp8",),
    ),
    "models": (("sharding",), ("attention",), ("llama",), ("hf_config", "hf_files"), ("hf",)),
    #  - the config and the run's extension points first; then the pieces that need only
    #    them (data, state layout, diagnostics hooks, checkpoints, optimizer); the plan
    #    (config + data validated), the traced step and what a run writes; then the
    #    compiled run (CompiledRun), the host loop (trainer), `loop.run` and the CLI.
    #  - hf (runs <-> HF checkpoints: export, model.init_from) needs the config, the
    #    checkpoints and the data's tokenizer; the plan checks init_from with it, the
    #    compiled run loads it.
    #    commands (the CLI's export-hf and mlperf-check) sit beside loop.
    "train": (
        ("jsonsafe", "execution"),
        ("config",),
        ("hooks", "process", "run_lock", "checkpoint", "optimizer", "preemption", "memory",
         "backend"),
        ("data", "state", "diagnostics", "devices"),
        ("hf",),
        ("output", "plan", "step"),
        ("compat", "run"),
        ("trainer", "check"),
        ("loop", "commands"),
        ("__main__",),
    ),
    "train.data": (("sources", "tokenizer"), ("cache", "loader", "records"),
                   ("grain_pipeline", "own_tokenizer"),
                   ("stream",), ("run_data",), ("__main__",)),
    "train.output": (("metrics", "mlperf", "tensorboard_log"), ("summary",), ("previous",)),
    "train.diagnostics": (("dynamics",), ("numerics",)),
    #  - the policies and the statistics need nothing of the study; the config names the
    #    policies; states and units need the config; the engine runs units on a
    #    CompiledRun; the probe and the report read what the engine wrote; the runner
    #    ties them together under the CLI.
    "study": (
        ("policies", "stats"),
        ("config",),
        ("states", "units"),
        ("engine",),
        ("probe", "report"),
        ("runner",),
        ("__main__",),
    ),
    "study.probe": (("capture",), ("analysis",), ("mechanism",)),
}
FACADE = "<facade>"  # a package's __init__
ABOVE_FACADE = "__main__"  # the one unit that may import its own package's facade


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _package(module: str) -> str:
    return module.split(".")[0]


def _inside(module: str, pkg: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


def _unit(module: str, pkg: str) -> str:
    """The unit of `module` in package `pkg`: 'train.data.cache' -> 'data' in 'train',
    'cache' in 'train.data'; the package itself -> its facade."""
    rest = module[len(pkg):].lstrip(".")
    return rest.split(".")[0] if rest else FACADE


def _is_module(name: str) -> bool:
    return name in MODULES


def _imports(module: str) -> list[tuple[str, int, str | None]]:
    """(imported project module, line, imported name or None) for every import in `module`."""
    path = MODULES[module]
    return _imports_in(module, path, path.read_text())


@functools.cache  # the checks walk every module, several times each
def _parse(path: pathlib.Path, source: str) -> ast.Module:
    return ast.parse(source, filename=str(path))


@functools.cache
def _imports_in(module: str, path: pathlib.Path, source: str) -> list[tuple[str, int, str | None]]:
    tree = _parse(path, source)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _package(alias.name) in PACKAGES:
                    out.append((alias.name, node.lineno, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source_mod = ".".join(base + ([node.module] if node.module else []))
            else:
                source_mod = node.module or ""
            if _package(source_mod) not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{source_mod}.{alias.name}"
                if _is_module(sub):  # `from mxjax import formats`: an edge to the submodule
                    out.append((sub, node.lineno, None))
                else:
                    out.append((source_mod, node.lineno, alias.name))
    return out


@functools.cache
def _private_attribute_uses(path: pathlib.Path, source: str) -> list[tuple[int, str, str]]:
    """(line, alias, attribute) where `alias` (a name imported from the project) is used as
    ``alias._private`` and names a module."""
    tree = _parse(path, source)
    imported = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and _package(n.module or "") in PACKAGES:
            for a in n.names:
                imported.setdefault(a.asname or a.name, f"{n.module}.{a.name}")
    return [(node.lineno, node.value.id, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
            and _is_module(imported.get(node.value.id, ""))]


def _edges():
    return {m: _imports(m) for m in MODULES}


def _layer_of(pkg: str) -> dict[str, int]:
    return {unit: i for i, units in enumerate(LAYERS[pkg]) for unit in units}


def test_layers_name_every_unit():
    for pkg in LAYERS:
        units = {_unit(m, pkg) for m in MODULES if _inside(m, pkg)} - {FACADE}
        assert units, f"LAYERS names {pkg!r}, which has no modules"
        assert units <= set(_layer_of(pkg)), f"add {sorted(units - set(_layer_of(pkg)))} to " \
                                             f"LAYERS[{pkg!r}]"
    subpackages = {m for m, p in MODULES.items() if p.name == "__init__.py" and "." in m}
    for sub in subpackages:
        parent = sub.rpartition(".")[0]
        assert sub in LAYERS or parent not in ("train", "study"), \
            f"{sub}: a subpackage of the loop or the study needs its own order in LAYERS"


def test_packages_import_only_lower_packages():
    order = {p: i for i, p in enumerate(PACKAGES)}
    bad = []
    for module, imports in _edges().items():
        for target, line, _ in imports:
            src, dst = _package(module), _package(target)
            if order[dst] > order[src]:
                bad.append(f"{_rel(MODULES[module])}:{line}: {module} -> {target} ({src} is "
                           f"below {dst}: {' -> '.join(PACKAGES)})")
    assert not bad, "imports against the package order:\n" + "\n".join(bad)


def test_imports_follow_the_layer_order():
    bad = []
    for module, imports in _edges().items():
        for pkg in LAYERS:
            if not _inside(module, pkg):
                continue
            layer = _layer_of(pkg)
            src = _unit(module, pkg)
            for target, line, _ in imports:
                if not _inside(target, pkg):
                    continue  # another package: test_packages_import_only_lower_packages
                dst = _unit(target, pkg)
                where = f"{_rel(MODULES[module])}:{line}: {module} -> {target}"
                if dst == FACADE:
                    if src not in (FACADE, ABOVE_FACADE):
                        bad.append(f"{where} (the facade of {pkg} is above every layer)")
                elif src in (FACADE, dst):
                    continue
                elif layer[dst] >= layer[src]:
                    bad.append(f"{where} ({src} is in layer {layer[src]} of {pkg}, {dst} in "
                               f"{layer[dst]})")
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
            private_parts = [p for p in target.split(".") if p.startswith("_")
                             and not p.startswith("__")]
            if private_parts:
                owner = target.rpartition(".")[0]  # a private module is private to its package
                if not (module == owner or module.startswith(owner + ".")):
                    bad.append(f"{where}: {module} imports {target}")
        path = MODULES[module]
        for line, alias, attr in _private_attribute_uses(path, path.read_text()):
            bad.append(f"{_rel(path)}:{line}: {module} uses {alias}.{attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _plant(tmp_path, monkeypatch, module: str, src: str) -> None:
    path = tmp_path / (module.replace(".", "_") + ".py")
    path.write_text(src)
    monkeypatch.setitem(MODULES, module, path)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The walker finds an import inside a function body and resolves relative imports."""
    _plant(tmp_path, monkeypatch, "mxjax.recipes",
           "def f():\n    from mxjax import nn\n    from mxjax.quantization import _core\n"
           "from . import formats\n")
    found = _imports("mxjax.recipes")
    assert ("mxjax.nn", 2, None) in found
    assert ("mxjax.quantization", 3, "_core") in found
    assert ("mxjax.formats", 4, None) in found
    with pytest.raises(AssertionError, match="recipes -> mxjax.nn"):
        test_imports_follow_the_layer_order()
    with pytest.raises(AssertionError, match="_core"):
        test_no_module_imports_another_modules_private_names()


@pytest.mark.parametrize("module, src, check, match", [
    # the loop reaching up into the study, in a function body
    ("train.loop", "def f():\n    from study import runner\n",
     test_packages_import_only_lower_packages, r"train.loop -> study.runner \(train is below"),
    # the model importing the loop; the library importing the model
    ("models.llama", "import train.config\n", test_packages_import_only_lower_packages,
     r"models.llama -> train.config"),
    ("mxjax.gemm", "from models import llama\n", test_packages_import_only_lower_packages,
     r"mxjax.gemm -> models.llama"),
    # inside train: the config above the plan; inside train.data: sources above cache
    ("train.config", "from train.plan import validate\n", test_imports_follow_the_layer_order,
     r"train.config -> train.plan \(config is in layer 1 of train, plan in 5\)"),
    ("train.data.sources", "from .cache import prepare\n", test_imports_follow_the_layer_order,
     r"train.data.sources -> train.data.cache \(sources is in layer 0 of train.data"),
    # a unit inside a package importing its own facade; two units of one layer
    ("study.engine", "import study\n", test_imports_follow_the_layer_order,
     r"study.engine -> study \(the facade of study"),
    ("study.report", "from study.probe import mechanism\n", test_imports_follow_the_layer_order,
     r"study.report -> study.probe.mechanism \(report is in layer 4 of study, probe in 4\)"),
    # a private name of another module of the loop
    ("train.trainer", "from train.step import _make_forward\n",
     test_no_module_imports_another_modules_private_names, r"train.step._make_forward"),
])
def test_the_checker_refuses_planted_violations(tmp_path, monkeypatch, module, src, check,
                                                match):
    check()  # the real tree passes
    _plant(tmp_path, monkeypatch, module, src)
    with pytest.raises(AssertionError, match=match):
        check()


def test_import_mxjax_loads_neither_flax_nor_the_kernels():
    # Pallas itself is imported with mxjax (the TPU form's kernel, mxjax.emulation.in_place_tpu):
    # importing it at the first quantized trace would make earlier programs recompile
    # (tests/mxjax/test_import_effects.py). mxjax's own kernels stay out until used.
    code = ("import sys, mxjax\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'flax' "
            "or m.startswith('mxjax.kernels') or m.startswith('mxjax.nn')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
