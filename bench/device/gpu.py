"""One script for a lent H200: GPU correctness tests, then the measured tables (< 5.5 min).

Usage, from the repository root on the GPU machine:

    # The H200 image has jax 0.11.2 and triton 3.6.0 but no jax-triton: carry a wheel.
    # Here (on the CPU machine), once:  echo /.whl/ >> .git/info/exclude
    #   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    #       --implementation cp -d .whl 'jax-triton>=0.3,<0.4'
    # There (carry .whl):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 bench/gpu.py [--quick] [--budget-s 300] \
        [--sections tests,ceilings,layer8b,gemm] [--quick-tests] [--keep-going] \
        [--layer-policies bf16/fused,bf16/explicit,fp8,mxfp4_all_h16,...] \
        [--table-out $OUT/table.txt] [--dump-autotune autotune_h200.pbtxt]

Sections (--sections picks them, they run in this order; the table is printed last, and
after every section when --table-out is given it is rewritten there):
  tests. pytest -m gpu tests/mxjax/kernels/test_kernels_gpu.py
     tests/mxjax/routes/test_fp8_units_gpu.py
     tests/models/test_fused_attention.py (kernels; FP8 GEMMs on the FP8 tensor cores within
     docs/NUMERICS.md's device bound, printed with -s; cuDNN flash attention against the
     explicit form); a failure stops the run unless --keep-going (then the table says so).
     --quick-tests deselects QUICK_TESTS_DESELECT (the slower half of the tests).
     Run in a subprocess before this process touches the GPU (both would preallocate).
  ceilings. Device copy bandwidth (bytes read + written) and bf16 GEMM TFLOP/s at 8192^3.
  layer8b. One Llama 3.1-8B decoder layer's train step (bench/programs.py's `layer_8b`:
     loss and gradients w.r.t. the layer's parameters and input, micro-batch 1, seq 8192)
     under each --layer-policies row (POLICY[@BACKEND][/ATTENTION][?]; default LAYER_ROWS:
     bf16 with fused and with explicit attention, fp8, mxfp4_all_h16 with the XLA
     emulation and with every GEMM on 'xla_fp8', nvfp4 if time remains). All rows are
     compiled first (a row that cannot be built or compiled says why), then timed in
     interleaved rounds (one call per row per round, the rows' order rotating), median of
     >= 5 rounds; ms and ratio to the bf16/fused row, compile seconds, XLA's temp memory.
     A row marked '?' is compiled after those rounds, if its compile fits the deadline,
     then all rows are timed in further rounds (the table is whole before it starts).
  quantize (not in the default set). The fused Pallas kernel's GB/s (row; row+column; with
     H16), its fraction of the copy bandwidth, and mxjax.quantize under XLA.
  gemm. MXFP4 GEMM TFLOP/s at 8192^3 and the Llama-3.1-8B projection shapes (8192 tokens)
     for bf16 jnp.dot and each --gemm-backends backend (default 'xla' (the XLA emulation),
     'pallas', 'pallas_fp8', 'triton' (tl.dot_scaled), 'xla_fp8'); a backend this mxjax
     does not know, or that cannot run here, is an n/a cell. Operands are quantized
     outside the timed region.
  train. Tokens/s of a ~1B Llama train step (AdamW) under 'bf16' and 'mxfp4_all_h16', the
     latter with the XLA emulation and with the kernels ('auto' backend).
  calibration. bench/accelerator_cost.py's matmul and 1B decoder-layer programs
     (bench/programs.py) under 'bf16' and 'mxfp4_all_h16', timed (ms per step). With
     --dump-autotune FILE, XLA writes the GEMM autotune results of every compile in this
     run to FILE (xla_gpu_dump_autotune_results_to; .pbtxt text, .pb binary); a deviceless
     compile then picks the same GEMM configs (bench/accelerator_cost.py --autotune-results
     FILE, which sets xla_gpu_load_autotune_results_from).
Time: --budget-s (default 300) is shared among the chosen measuring sections by
SECTION_WEIGHT, time a section leaves unused passing on to the later ones; a section does
not start a row (a compile, a shape, a step) it cannot expect to finish by its deadline
(from its longest row so far) and writes 'skipped (time budget)' instead. The tests, a
subprocess, are killed (a failure) at half the budget. A watchdog prints the table so far
and exits (code 3) at --hard-limit-s (default budget + 25 s) if a compile or kernel
overruns anyway. Expected on the H200 (estimates from compile counts and deviceless compile
times, not yet measured): tests ~90 s (--quick-tests ~55 s; pytest's --durations prints
the slowest), ceilings ~5 s, layer8b ~120-180 s for its six compiles (nvfp4, the last, is
the one the budget drops first), gemm what is left (each shape ~15 s).
Targets (issue 7): quantize >= 80% of copy bandwidth; MXFP4 GEMM >= 1.0x bf16 at 8192^3
(1.5x through the FP8 path as the stretch); the 1B step under mxfp4_all_h16 with kernels
no slower than under bf16; (issue 10) the 1B step under mxfp4_all_h16 with the XLA emulation
(backend='xla': bf16 operands at DEFAULT on the GPU, docs/NUMERICS.md) at most 1.3x the bf16
step time (stretch 1.15x): the 'step time vs bf16' column.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

T0 = time.perf_counter()  # before jax's import: the budget counts it

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp

_STATE: dict = {"doing": "starting", "child": None}  # for the watchdog: last log line, pytest


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    _STATE["doing"] = msg
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def timeit(fn, *args, iters: int = 10, warmup: int = 2) -> float:
    """Median seconds per call of a jitted fn (compile in the warm-up)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    copy_elems: int  # f32 elements copied
    gemm_ceiling: int  # bf16 GEMM ceiling size (cube)
    quant: int  # quantize input is quant x quant bf16
    gemm_div: int  # GEMM shapes divided by this
    gemm_shapes: int  # how many of GEMM_SHAPES
    train: tuple[int, int, int]  # batch, seq, layers
    layer: tuple[str, int] | None  # layer8b: (LlamaConfig preset, seq); None: layer_8b's own
    layer_rounds: int = 7  # layer8b: timed rounds (>= MIN_ROUNDS)
    tiny_model: bool = False


FULL = Sizes(copy_elems=1 << 28, gemm_ceiling=8192, quant=8192, gemm_div=1, gemm_shapes=5,
             train=(4, 2048, 16), layer=None)
QUICK = Sizes(copy_elems=1 << 26, gemm_ceiling=4096, quant=4096, gemm_div=2, gemm_shapes=2,
              train=(2, 1024, 4), layer=("llama3_8b", 2048))
# --cpu-smoke: every code path on CPU (Pallas interpreted), numbers meaningless.
SMOKE = Sizes(copy_elems=1 << 16, gemm_ceiling=256, quant=256, gemm_div=64, gemm_shapes=2,
              train=(1, 64, 1), layer=("tiny", 64), layer_rounds=5, tiny_model=True)

SKIPPED = "skipped (time budget)"


class Table:
    def __init__(self):
        self.sections: list[tuple[str, list[tuple[str, ...]]]] = []

    def section(self, title: str, header: tuple[str, ...]):
        """The section's row list (append tuples; a str is a note line below the rows)."""
        rows: list = [header]
        self.sections.append((title, rows))
        return rows

    def render(self) -> str:
        out = ["=" * 100]
        for title, rows in list(self.sections):
            out.append(f"\n## {title}")
            notes = [r for r in rows if isinstance(r, str)]
            rows = [r for r in rows if not isinstance(r, str)]
            ncol = max(len(r) for r in rows)
            rows = [tuple(r) + ("",) * (ncol - len(r)) for r in rows]
            widths = [max(len(str(r[i])) for r in rows) for i in range(ncol)]
            for j, r in enumerate(rows):
                out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
                if j == 0:
                    out.append("  " + "  ".join("-" * w for w in widths))
            out += [f"  {n}" for n in notes]
        out.append("=" * 100)
        return "\n".join(out)

    def print(self):
        print("\n" + self.render(), flush=True)

    def write(self, path: Path | None) -> None:
        """Rewrites `path` with the table so far (None: nothing)."""
        if path is not None:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self.render() + "\n")
            tmp.replace(path)


def short_error(e: BaseException, limit: int = 110) -> str:
    """'n/a: Type: message' within `limit` characters (the message's first line; its middle
    elided when long, so that the end, e.g. "got 'xla_fp8'", stays)."""
    msg = " ".join(str(e).strip().splitlines()[0].split()) if str(e).strip() else ""
    text = f"n/a: {type(e).__name__}: {msg}"
    if len(text) > limit:
        head = limit * 3 // 5
        text = text[:head] + " ... " + text[-(limit - head - 5):]
    return text


# --------------------------------------------------------------------------- time budget

SECTIONS = ("tests", "ceilings", "layer8b", "quantize", "gemm", "train", "calibration")
DEFAULT_SECTIONS = ("tests", "ceilings", "layer8b", "gemm", "train", "calibration")
# Each chosen measuring section's share of the budget left when it starts: its weight over
# the weights of the sections still to run (about the seconds each needs on the H200). The
# tests have no share: their timeout is half the budget, and what they leave is shared.
SECTION_WEIGHT = {"ceilings": 10, "layer8b": 170, "quantize": 25, "gemm": 70, "train": 60,
                  "calibration": 45}


class Budget:
    """Deadlines (seconds since start) for the sections still to run, out of ``total_s``."""

    def __init__(self, total_s: float, sections):
        self.total_s = total_s
        self.pending = list(sections)

    def start(self, name: str) -> float:
        weights = sum(SECTION_WEIGHT[s] for s in self.pending)
        share = SECTION_WEIGHT[name] / weights
        self.pending.remove(name)
        return elapsed() + max(0.0, self.total_s - elapsed()) * share


class Pace:
    """A section's deadline and its longest step so far: a step starts only when that
    much time (plus ``reserve``) is left before the deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.longest = 0.0

    def ok(self, reserve: float = 0.0) -> bool:
        return elapsed() + self.longest + reserve <= self.deadline

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


# --------------------------------------------------------------------------- tests

GPU_TEST_FILES = ("tests/mxjax/kernels/test_kernels_gpu.py",
                  "tests/mxjax/routes/test_fp8_units_gpu.py",
                  "tests/models/test_fused_attention.py",
                  "tests/mxjax/routes/test_xla_fp8_gpu.py",
                  "tests/mxjax/routes/test_xla_fp4_gpu.py")
# --quick-tests deselects these (node-id prefixes; a test added to the files still runs):
# the fused-quantize kernel tests, the second GEMM shape, the batched Pallas GEMM, the FP8
# tensor-core bound at K = 256 (K = 4096 stays).
_KERNELS, _FP8, _ATTN, _XLA_FP8, _FP4 = GPU_TEST_FILES
QUICK_TESTS_DESELECT = (
    f"{_KERNELS}::test_fused_quantize_bit_exact",
    f"{_KERNELS}::test_fused_quantize_stochastic",
    f"{_KERNELS}::test_gemm_backends_within_tolerance[shape1]",
    f"{_KERNELS}::test_batched_pallas",
    f"{_FP8}::test_tensor_core_gemm_is_within_the_device_bound[256-",
    _FP4,  # the B200 route (on Hopper XLA expands its block-scaled dot to f32)
)


def run_gpu_tests(quick: bool, timeout_s: float) -> tuple[bool, str]:
    """Runs the -m gpu tests in a subprocess (its output goes to ours): (passed, summary).

    Call before this process initializes the GPU: both processes would preallocate.
    """
    deselect = [a for d in QUICK_TESTS_DESELECT for a in ("--deselect", d)] if quick else []
    log(f"running GPU correctness tests ({'--quick-tests subset' if quick else 'all'}; "
        f"timeout {timeout_s:.0f} s): pytest -m gpu {' '.join(GPU_TEST_FILES)}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # --dump-autotune's file is this process's compiles only.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_gpu_dump_autotune_results_to"))
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rxs",
         "-s", "--durations=12", *deselect, *GPU_TEST_FILES],
        cwd=ROOT, env=env, start_new_session=True)
    _STATE["child"] = proc
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False, f"FAILED: timed out after {timeout_s:.0f} s (killed)"
    finally:
        _STATE["child"] = None
    took = time.perf_counter() - t
    which = "quick subset" if quick else "all"
    if rc != 0:
        return False, f"FAILED (pytest exit code {rc}, {which}, {took:.0f} s)"
    return True, f"passed ({which}, {took:.0f} s)"


# --------------------------------------------------------------------------- ceilings


def ceilings(table: Table, sz: Sizes, deadline: float) -> float | None:
    rows = table.section("Ceilings (measured)", ("what", "value"))
    if elapsed() > deadline:
        rows.append(("ceilings", SKIPPED))
        return None
    n = sz.copy_elems
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    t = timeit(copy, x)
    del x
    bw = 2 * 4 * n / t / 1e9
    rows.append(("device copy (read+write)", f"{bw:8.0f} GB/s"))
    s = sz.gemm_ceiling
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (s, s), jnp.bfloat16)
    b = jax.random.normal(k2, (s, s), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16))
    t = timeit(mm, a, b)
    del a, b
    tf = 2 * s**3 / t / 1e12
    rows.append((f"bf16 jnp.dot {s}^3", f"{tf:8.1f} TFLOP/s"))
    log(f"copy {bw:.0f} GB/s, bf16 GEMM {tf:.1f} TFLOP/s")
    return bw


# --------------------------------------------------------------------------- layer8b

ATTENTION_IMPLS = ("fused", "explicit", "jax")  # models.llama.LlamaConfig.attention_impl
# 'xla_fp4' (auto's route on Blackwell) if time remains; elsewhere its row is the error
# that names the chip (it needs FP4 MMA).
LAYER_ROWS = ("bf16/fused,bf16/explicit,fp8,mxfp4_all_h16,mxfp4_all_h16@xla_fp8,"
              "mxfp4_all_h16@xla_fp4?,nvfp4?")
MIN_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One --layer-policies entry: POLICY[@BACKEND][/ATTENTION][?]."""

    policy: str  # as given: a mxjax.policies preset or alias ('bf16': 'passthrough')
    backend: str | None  # every GEMM's backend; None: the preset's own
    attention: str  # LlamaConfig.attention_impl
    optional: bool = dataclasses.field(default=False, compare=False)  # '?': if time remains

    @property
    def preset(self) -> str:
        """The current preset name ('bf16' is the deprecated alias of 'passthrough')."""
        from mxjax import policies

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return policies.canonical_name(self.policy)

    @property
    def is_baseline(self) -> bool:
        return self.preset == "passthrough" and self.backend is None and \
            self.attention == "fused"

    @property
    def label(self) -> str:
        return (f"{self.policy}{'@' + self.backend if self.backend else ''}/{self.attention}"
                f"{'?' if self.optional else ''}")


def parse_layer_rows(text: str) -> list[LayerRow]:
    """--layer-policies: comma-separated POLICY[@BACKEND][/ATTENTION][?] (attention default
    'fused'; a trailing '?': compiled only after the other rows have been timed, if time
    remains). The policy must be a preset; the backend is not checked here (a backend this
    mxjax does not know is that row's error, not the run's)."""
    from mxjax import policies

    rows = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        optional = item.endswith("?")
        rest, _, attention = item.removesuffix("?").partition("/")
        policy, _, backend = rest.partition("@")
        attention = attention or "fused"
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"--layer-policies: {item!r}: attention must be one of "
                             f"{ATTENTION_IMPLS}, got {attention!r}")
        if "@" in rest and not backend:
            raise ValueError(f"--layer-policies: {item!r}: empty backend after '@'")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                policies.get(policy)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"--layer-policies: {item!r}: unknown policy {policy!r} "
                             f"({type(e).__name__}: {e})") from None
        row = LayerRow(policy=policy, backend=backend or None, attention=attention,
                       optional=optional)
        if row not in rows:  # a repeated row would be timed once anyway
            rows.append(row)
    if not rows:
        raise ValueError(f"--layer-policies: no rows in {text!r}")
    return rows


def _with_backend(policy, backend: str):
    """`policy` with every GEMM's backend set (ValueError naming it if mxjax lacks it)."""
    return dataclasses.replace(
        policy,
        fprop=dataclasses.replace(policy.fprop, backend=backend),
        dgrad=dataclasses.replace(policy.dgrad, backend=backend),
        wgrad=dataclasses.replace(policy.wgrad, backend=backend),
    )


def _layer_program(row: LayerRow, sz: Sizes):
    """(fn, abstract args, description) of the 8B layer's train step for `row`."""
    from bench import programs
    from mxjax import policies

    policy = policies.get(row.preset)
    if row.backend is not None:
        policy = _with_backend(policy, row.backend)
    size, seq = sz.layer or (programs.LAYER_PROGRAMS["layer_8b"], programs.LAYER_8B_SEQ)
    fn, args = programs.layer_program(policy, 1, seq, size=size, attention_impl=row.attention)
    return fn, args, f"{size} layer, micro-batch 1 x seq {seq}"


def _arg_signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return (treedef, tuple((tuple(a.shape), str(a.dtype)) for a in leaves))


def _temp_gb(compiled) -> str:
    try:
        stats = compiled.memory_analysis()
        return f"{stats.temp_size_in_bytes / 1e9:6.2f}"
    except Exception:  # noqa: BLE001 - not every backend reports it
        return "?"


def layer8b_section(table: Table, sz: Sizes, deadline: float, rows_spec: list[LayerRow]) -> None:
    """Compiles every row, then times them in interleaved rounds (see the module doc).

    The section's rows are rewritten after every compile and round, so that a table printed
    early (the watchdog's) shows what is done.
    """
    from bench import programs

    rows = table.section(
        "Llama 3.1-8B decoder layer, seq 8192, fwd+bwd (ms, ratio to bf16)",
        ("policy", "GEMM backend", "attention", "compile s", "temp GB", "ms (median)", "n",
         "min ms", "vs bf16/fused", "deviceless est. ms", "note"))
    pace = Pace(deadline)
    args_cache: dict = {}
    live: dict[LayerRow, dict] = {}  # compiled: {"fn", "args", "compile", "temp", "call", "times"}
    why: dict[LayerRow, str] = {}  # rows with no time: the error, or SKIPPED
    program_note = []

    def publish(final: bool) -> None:
        timed = [(r, statistics.median(e["times"])) for r, e in live.items()
                 if r not in why and e["times"]]
        base = next((t for r, t in timed if r.is_baseline), None)
        base_note = ""
        if base is None:  # the ratio to another bf16 row, said in each row's note
            r, base = next(((r, t) for r, t in timed if r.preset == "passthrough"),
                           (None, None))
            base_note = f"ratio to {r.label} (no bf16/fused)" if r else "no bf16 row timed"
        out = []
        for row in rows_spec:
            cells = (row.policy + ("?" if row.optional else ""), row.backend or "-",
                     row.attention)
            e = live.get(row)
            if e is None or row in why or not e["times"]:
                note = why.get(row, f"compiled, not timed yet (warm call {e['call'] * 1e3:.2f} "
                                    "ms)" if e else
                               "n/a: not reached" if final else "not compiled yet")
                out.append(cells + (f"{e['compile']:.1f}" if e else "", e["temp"] if e else "",
                                    "skipped" if note == SKIPPED else "n/a", "", "", "", "",
                                    note))
                continue
            ms = statistics.median(e["times"]) * 1e3
            ratio = f"{ms / (base * 1e3):5.2f}x" if base else "n/a"
            note = base_note
            if len(e["times"]) < MIN_ROUNDS:
                note = f"only {len(e['times'])} rounds so far; " + note
            out.append(cells + (f"{e['compile']:.1f}", e["temp"], f"{ms:8.2f}",
                                str(len(e["times"])), f"{min(e['times']) * 1e3:8.2f}", ratio, "",
                                note.strip("; ")))
        rows[1:] = out + program_note

    def compile_row(row: LayerRow) -> None:
        # Leave time for the rounds: each compiled row, and this one, MIN_ROUNDS calls.
        calls = [e["call"] for e in live.values()]
        reserve = MIN_ROUNDS * (sum(calls) + max(calls, default=0.0)) + 1.0
        if not pace.ok(reserve):
            why[row] = SKIPPED
            return
        log(f"layer8b: building and compiling {row.label}")
        t = time.perf_counter()
        try:
            fn, abstract, what = _layer_program(row, sz)
            note = (f"program: {what} (bench/programs.py layer_program); GEMM backend '-': "
                    "the preset's own; ms: median of the interleaved rounds, one call per row "
                    "per round; rows marked ? were compiled after the others were timed, then "
                    "all were timed in further rounds")
            program_note[:] = [note]
            sig = _arg_signature(abstract)
            if sig not in args_cache:
                args_cache[sig] = programs.concrete_args(abstract)
            args = args_cache[sig]
            compiled = jax.jit(fn).lower(*args).compile()
            compile_s = time.perf_counter() - t
            for _ in range(2):  # warm-up; its time bounds a call for the reserve above
                tc = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                call = time.perf_counter() - tc
            live[row] = {"fn": compiled, "args": args, "compile": compile_s,
                         "temp": _temp_gb(compiled), "call": call, "times": []}
            log(f"layer8b: {row.label} compiled in {compile_s:.1f} s, "
                f"temp {live[row]['temp']} GB, warm call {call * 1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001 - a row that cannot build or compile says why
            why[row] = short_error(e)
            log(f"layer8b: {row.label}: {why[row]}")
        finally:
            pace.took(time.perf_counter() - t)
        publish(False)

    def rounds() -> None:
        order = [r for r in live if r not in why]
        for n in range(sz.layer_rounds):
            if n >= MIN_ROUNDS and elapsed() > deadline:
                break
            k = n % len(order) if order else 0
            for row in order[k:] + order[:k]:  # the rows' order rotates round by round
                if row in why:
                    continue  # failed in an earlier round
                e = live[row]
                try:
                    tc = time.perf_counter()
                    jax.block_until_ready(e["fn"](*e["args"]))
                    e["times"].append(time.perf_counter() - tc)
                except Exception as err:  # noqa: BLE001 - reported in the table
                    why[row] = short_error(err)
            publish(False)

    publish(False)
    for row in rows_spec:
        if not row.optional:
            compile_row(row)
    rounds()
    for row in rows_spec:
        if row.optional:
            compile_row(row)
            if row in live:
                rounds()
    publish(True)
    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    if "peak_bytes_in_use" in stats:
        rows.append(f"device peak memory in use so far (this process): "
                    f"{stats['peak_bytes_in_use'] / 1e9:.1f} GB")
    for i, row in enumerate(rows_spec):
        c = dict(zip(rows[0], rows[1 + i]))
        log(f"layer8b {row.label}: compile {c['compile s'] or '-'} s, {c['ms (median)'].strip()}"
            f" ms (n={c['n'] or 0}), {c['vs bf16/fused'].strip() or '-'} {c['note']}".rstrip())
    live.clear()
    args_cache.clear()  # frees the parameters before the next section


# --------------------------------------------------------------------------- quantize


def quantize_section(table: Table, copy_bw: float | None, sz: Sizes, deadline: float) -> None:
    import mxjax
    from mxjax.kernels import QuantSpec, fused_quantize

    rows = table.section("Quantize MXFP4 (bf16 input; bytes = read + written)",
                         ("kernel", "shape", "GB/s", "of copy BW"))
    pace = Pace(deadline)
    r = c = sz.quant
    x = jax.random.normal(jax.random.key(1), (r, c), jnp.bfloat16)
    signs = mxjax.fixed_signs(0, 16)
    even = mxjax.OperandRecipe(fmt=mxjax.MXFP4, scale_rule="even")
    per_copy = r * c // 2 + r * c // 32

    def frac(gbs):
        return f"{gbs / copy_bw:6.1%}" if copy_bw else "(no ceilings)"

    cases = [
        ("fused row", {"row": QuantSpec(recipe=even)}, 1),
        ("fused row+col", {"row": QuantSpec(recipe=even),
                           "col": QuantSpec(recipe=even)}, 2),
        ("fused row H16", {"row": QuantSpec(recipe=even, hadamard=16),
                           "row_signs": signs}, 1),
        ("fused row+col H16", {"row": QuantSpec(recipe=even, hadamard=16),
                                   "col": QuantSpec(recipe=even, hadamard=16),
                                   "row_signs": signs, "col_signs": signs}, 2),
    ]
    def timed(name, fn, moved):
        """One row: fn jitted on x, `moved` bytes (read + written) per call."""
        if not pace.ok():
            rows.append((name, f"{r}x{c}", SKIPPED, ""))
            return
        t0 = time.perf_counter()
        try:
            gbs = moved / timeit(jax.jit(fn), x) / 1e9
            rows.append((name, f"{r}x{c}", f"{gbs:7.0f}", frac(gbs)))
        except Exception as e:  # noqa: BLE001 - a kernel that cannot lower is a row, not a crash
            rows.append((name, f"{r}x{c}", short_error(e), ""))
        pace.took(time.perf_counter() - t0)

    for name, kw, copies in cases:
        timed(name, functools.partial(fused_quantize, **kw), 2 * r * c + copies * per_copy)
    from mxjax import policies
    from mxjax.kernels import target_chip
    from mxjax.routes import in_place, xla_fp4
    from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt

    op = policies.get("mxfp4_all_h16").fprop.lhs
    nv_copy = r * c // 2 + r * c // 16  # E2M1 codes + per-16 scale bytes
    # The route's conversion on this chip: PTX's cvt on Blackwell, integer rounding before.
    e2m1_cvt = has_e2m1_cvt(target_chip("gpu").compute_capability)

    def fp4_kernel(v, axis, pair):
        return xla_fp4.kernel_operand(v, axis, op, hadamard_size=16, signs=None,
                                      k_out=v.shape[axis], pair=pair, e2m1_cvt=e2m1_cvt)

    def fp4_xla(v, axis):
        view = in_place.contraction_view(v, (), (axis,))
        return xla_fp4.in_place_operand(view, op, None, k_out=v.shape[axis],
                                        hadamard_size=16, signs=None)

    # The 'xla_fp4' route's operands (H16, NVFP4 re-encoding included): its one-pass
    # kernel (mxjax.routes.xla_fp4_kernel) against the XLA form it replaces on GPUs.
    fp4_cases = [
        ("fp4_operand row H16", functools.partial(fp4_kernel, axis=1, pair=False), 1),
        ("fp4_operand col H16", functools.partial(fp4_kernel, axis=0, pair=False), 1),
        ("fp4_operand pair H16", lambda v: fp4_kernel(v, 1, True)[:2] + fp4_kernel(
            v, 0, True)[:2], 2),
        ("XLA xla_fp4 operand row H16", functools.partial(fp4_xla, axis=1), 1),
        ("XLA xla_fp4 operand col H16", functools.partial(fp4_xla, axis=0), 1),
    ]
    for name, fn, copies in fp4_cases:
        timed(name, fn, 2 * r * c + copies * nv_copy)
    xla_cases = [
        ("XLA mxjax.quantize row",
         lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=1, scale_rule="even")),
        ("XLA hadamard16+quantize row", lambda v: mxjax.quantize(
            mxjax.hadamard(v, 16, axis=1, signs=signs), mxjax.MXFP4, axis=1, scale_rule="even")),
    ]
    for name, fn in xla_cases:
        timed(name, fn, 2 * r * c + per_copy)
    log("quantize section done")


# --------------------------------------------------------------------------- gemm

GEMM_SHAPES = [  # (name, M, N, K); M = 8192 tokens
    ("8192^3", 8192, 8192, 8192),
    ("8B qkv", 8192, 6144, 4096),
    ("8B o", 8192, 4096, 4096),
    ("8B gate/up", 8192, 14336, 4096),
    ("8B down", 8192, 4096, 14336),
]
GEMM_BACKENDS = "xla,pallas,pallas_fp8,triton,xla_fp8"


def gemm_section(table: Table, sz: Sizes, deadline: float, backends: list[str]) -> None:
    import mxjax
    from mxjax.kernels import capabilities, mx_dot

    caps = capabilities()
    rows = table.section(
        "MXFP4 GEMM TFLOP/s (ratio to bf16 jnp.dot)",
        ("shape", "bf16 dot") + tuple(backends))
    pace = Pace(deadline)
    for name, m, n, k in GEMM_SHAPES[: sz.gemm_shapes]:
        m, n, k = m // sz.gemm_div, n // sz.gemm_div, k // sz.gemm_div
        label = f"{name} {m}x{n}x{k}"
        if not pace.ok():
            rows.append((label, SKIPPED) + ("",) * len(backends))
            continue
        t0 = time.perf_counter()
        k1, k2 = jax.random.split(jax.random.key(2))
        a = jax.random.normal(k1, (m, k), jnp.bfloat16)
        b = jax.random.normal(k2, (k, n), jnp.bfloat16)
        flops = 2 * m * n * k
        t_bf16 = timeit(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16)),
                        a, b)
        bf = flops / t_bf16 / 1e12
        lq = jax.jit(lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=1, scale_rule="even"))(a)
        rq = jax.jit(lambda v: mxjax.quantize(v, mxjax.MXFP4, axis=0, scale_rule="even"))(b)
        del a, b
        pace.took(time.perf_counter() - t0)
        cells = [f"{bf:6.1f}"]
        for be in backends:
            if not pace.ok():
                cells.append(SKIPPED)
                continue
            t0 = time.perf_counter()
            try:  # caps.reason raises ValueError for a backend this mxjax does not know
                if not caps.can_run(be):
                    cells.append(f"n/a ({caps.reason(be)[:40]})")
                    continue
                t = timeit(jax.jit(functools.partial(mx_dot, backend=be)), lq, rq,
                           iters=5 if be == "xla" else 10)
                tf = flops / t / 1e12
                cells.append(f"{tf:6.1f} ({tf / bf:4.2f}x)")
            except Exception as e:  # noqa: BLE001 - reported in the table
                cells.append(short_error(e, limit=72))
            finally:
                pace.took(time.perf_counter() - t0)
        del lq, rq
        rows.append((label,) + tuple(cells))
        log(f"GEMM {name}: " + " | ".join(cells))
    try:
        if "triton" in backends and not caps.can_run("triton"):
            rows.append(f"triton: {caps.reason('triton')}")
    except ValueError:
        pass


# --------------------------------------------------------------------------- train


def train_section(table: Table, sz: Sizes, deadline: float) -> None:
    import optax
    from flax import nnx

    from models.llama import Llama, LlamaConfig
    from mxjax import policies
    from mxjax.kernels import resolve_backend

    rows = table.section("~1B Llama train step (AdamW), tokens/s",
                         ("policy", "backend", "tokens/s", "vs bf16", "step time vs bf16"))
    pace = Pace(deadline)
    batch, seq, layers = sz.train
    if sz.tiny_model:
        cfg = LlamaConfig.tiny(n_layers=layers, max_seq_len=seq)
    else:
        cfg = LlamaConfig.llama3_1b(n_layers=layers, max_seq_len=seq, dtype="bfloat16",
                                    param_dtype="float32")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-4)
    tokens = jax.random.randint(jax.random.key(3), (batch, seq + 1), 0, cfg.vocab_size)

    def make_step(policy):
        def loss_fn(p, key):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1], policy=policy, policy_key=key)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens[:, 1:]).mean()

        @jax.jit
        def step(p, s, key):
            loss, g = jax.value_and_grad(loss_fn)(p, key)
            upd, s = opt.update(g, s, p)
            return optax.apply_updates(p, upd), s, loss

        return step

    h16 = policies.get("mxfp4_all_h16")
    kernel_backend = "pallas" if sz.tiny_model else resolve_backend("auto")
    configs = [("bf16", None, "-"), ("mxfp4_all_h16", h16, "xla")]
    try:
        configs.append(("mxfp4_all_h16", _with_backend(h16, kernel_backend), kernel_backend))
    except Exception as e:  # noqa: BLE001 - reported in the table
        rows.append(("mxfp4_all_h16", kernel_backend, short_error(e), ""))
    base = None
    key = jax.random.key(4)
    for name, policy, be in configs:
        if not pace.ok():
            rows.append((name, be, SKIPPED, ""))
            continue
        t0 = time.perf_counter()
        try:
            step = make_step(policy)
            state = (params, opt.init(params))

            def run(st, step=step):
                p, s, _ = step(st[0], st[1], key)
                return (p, s)

            t = timeit(run, state, iters=5, warmup=2)
            del state
            tps = batch * seq / t
            base = tps if name == "bf16" else base
            rows.append((name, be, f"{tps:10.0f}", f"{tps / base:5.2f}x" if base else "",
                         f"{base / tps:5.2f}x" if base else ""))
            log(f"train {name} [{be}]: {tps:.0f} tokens/s")
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append((name, be, short_error(e), ""))
        pace.took(time.perf_counter() - t0)
    name = "tiny" if sz.tiny_model else "llama3_1b"
    rows.append(f"config: {layers} layers of {name}, batch {batch} x seq {seq}")
    del params, model


# --------------------------------------------------------------------------- calibration

CALIBRATION_POLICIES = ("bf16", "mxfp4_all_h16")


def calibration_section(table: Table, sz: Sizes, deadline: float) -> None:
    """Times bench/programs.py's matmul and layer steps (the deviceless estimates' programs)."""
    from bench import programs

    rows = table.section("accelerator_cost programs, measured (calibrates the deviceless "
                         "roofline)", ("program", "policy", "ms/step", "vs bf16"))
    pace = Pace(deadline)
    size = {"matmul_size": sz.gemm_ceiling // 2, "seq": sz.train[1]} if sz.tiny_model else {}
    for prog in programs.PROGRAMS:
        base = None
        for name in CALIBRATION_POLICIES:
            if not pace.ok():
                rows.append((prog, name, SKIPPED, ""))
                continue
            t0 = time.perf_counter()
            try:
                fn, args = programs.program(prog, name, **size)
                args = programs.concrete_args(args)
                t = timeit(jax.jit(fn), *args, iters=5, warmup=2)
                del args
                base = t if name == "bf16" else base
                rows.append((prog, name, f"{t * 1e3:8.3f}", f"{t / base:5.2f}x" if base else ""))
                log(f"calibration {prog} {name}: {t * 1e3:.3f} ms")
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows.append((prog, name, short_error(e), ""))
            pace.took(time.perf_counter() - t0)


# --------------------------------------------------------------------------- main


def _add_xla_flag(flag: str) -> None:
    """Appends to XLA_FLAGS (read when the first backend starts: call before any jax use)."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _parse_sections(text: str) -> tuple[str, ...]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in SECTIONS]
    if unknown or not chosen:
        raise ValueError(f"--sections: unknown {unknown or text!r}; expected a comma-separated "
                         f"subset of {','.join(SECTIONS)}")
    return tuple(s for s in SECTIONS if s in chosen)  # always in SECTIONS' order


def _start_watchdog(limit_s: float, table: Table, run_rows: list, table_out: Path | None):
    """At `limit_s` seconds: kill the pytest child, print the table so far, exit 3."""

    def fire():
        print(f"\n[{elapsed():6.1f}s] watchdog: --hard-limit-s {limit_s:.0f} reached while: "
              f"{_STATE['doing']}; printing the table so far and exiting (3)", flush=True)
        child = _STATE.get("child")
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        doing = _STATE["doing"][:80]
        run_rows.append(("stopped", f"by the watchdog at {elapsed():.0f} s, while: {doing}"))
        try:
            table.write(table_out)
        finally:
            table.print()
            os._exit(3)

    timer = threading.Timer(max(0.0, limit_s - elapsed()), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="seconds for all chosen sections, shared by SECTION_WEIGHT; what "
                         "does not fit is a 'skipped (time budget)' row (default 300)")
    ap.add_argument("--hard-limit-s", type=float, default=None,
                    help="print the table and exit (code 3) at this many seconds even in the "
                         "middle of a compile (default: --budget-s + 25)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated, run in this order: {','.join(SECTIONS)} "
                         f"(default {','.join(DEFAULT_SECTIONS)})")
    ap.add_argument("--skip-tests", action="store_true",
                    help="drop 'tests' from --sections (only to re-run the table after they "
                         "passed)")
    ap.add_argument("--quick-tests", action="store_true",
                    help="the tests section deselects QUICK_TESTS_DESELECT (the slower half)")
    ap.add_argument("--keep-going", action="store_true",
                    help="measure even when the GPU tests fail (the table says they failed)")
    ap.add_argument("--layer-policies", default=LAYER_ROWS, metavar="ROWS",
                    help="layer8b rows, comma-separated POLICY[@BACKEND][/ATTENTION] "
                         "(attention fused|explicit|jax, default fused; @BACKEND sets every "
                         f"GEMM's backend); default {LAYER_ROWS}")
    ap.add_argument("--gemm-backends", default=GEMM_BACKENDS,
                    help=f"gemm section columns (default {GEMM_BACKENDS})")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="developer check on CPU: every section at toy sizes, numbers "
                         "meaningless (tests are not run)")
    ap.add_argument("--table-out", type=Path, default=None, metavar="FILE",
                    help="also write the table to FILE, rewritten after every section")
    ap.add_argument("--dump-autotune", type=Path, default=None, metavar="FILE",
                    help="write XLA's GPU autotune results to FILE (xla_gpu_dump_autotune_"
                         "results_to) for bench/accelerator_cost.py --autotune-results")
    args = ap.parse_args(argv)
    try:
        sections = _parse_sections(args.sections)
        layer_rows = parse_layer_rows(args.layer_policies) if "layer8b" in sections else []
    except ValueError as e:
        ap.error(str(e))
    gemm_backends = [b.strip() for b in args.gemm_backends.split(",") if b.strip()]
    if args.skip_tests:
        sections = tuple(s for s in sections if s != "tests")
    sz = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    hard_limit = args.hard_limit_s if args.hard_limit_s is not None else args.budget_s + 25
    if args.dump_autotune is not None:
        args.dump_autotune = args.dump_autotune.resolve()
        args.dump_autotune.parent.mkdir(parents=True, exist_ok=True)
        _add_xla_flag(f"--xla_gpu_dump_autotune_results_to={args.dump_autotune}")

    table = Table()
    info = table.section("Device", ("what", "value"))
    run_rows = table.section("Run", ("what", "value"))
    run_rows += [("sections", ",".join(sections)),
                 ("budget", f"{args.budget_s:.0f} s (hard limit {hard_limit:.0f} s)")]
    watchdog = _start_watchdog(hard_limit, table, run_rows, args.table_out)
    budget = Budget(args.budget_s, [s for s in sections if s != "tests"])
    if "tests" in sections:  # before this process touches the GPU
        if args.cpu_smoke:
            run_rows.append(("GPU tests", "not run (--cpu-smoke)"))
        else:
            ok, summary = run_gpu_tests(args.quick_tests, timeout_s=max(60.0, args.budget_s / 2))
            run_rows.append(("GPU tests", summary))
            log(f"GPU correctness tests: {summary}")
            if not ok and not args.keep_going:
                log("not benchmarking (--keep-going measures anyway)")
                watchdog.cancel()
                table.write(args.table_out)
                table.print()
                return 1
    if jax.default_backend() != "gpu" and not args.cpu_smoke:
        print(f"bench/gpu.py needs a CUDA GPU; jax.default_backend() is "
              f"{jax.default_backend()!r} (devices: {jax.devices()}). Run it on the lent H200.",
              file=sys.stderr)
        return 2
    from mxjax.kernels import capabilities

    caps = capabilities()
    log(f"jax {jax.__version__}, {caps}")
    info += [("device", caps.device_kind), ("compute capability", str(caps.compute_capability)),
             ("native FP4", str(caps.native_fp4)), ("runnable backends", ", ".join(caps.runnable)),
             ("jax", jax.__version__)]
    copy_bw = None
    for name in sections:
        if name == "tests":
            continue
        deadline = budget.start(name)
        log(f"section {name} (deadline {deadline:.0f} s)")
        try:
            if name == "ceilings":
                copy_bw = ceilings(table, sz, deadline)
            elif name == "layer8b":
                layer8b_section(table, sz, deadline, layer_rows)
            elif name == "quantize":
                quantize_section(table, copy_bw, sz, deadline)
            elif name == "gemm":
                gemm_section(table, sz, deadline, gemm_backends)
            elif name == "train":
                train_section(table, sz, deadline)
            elif name == "calibration":
                calibration_section(table, sz, deadline)
        except Exception as e:  # noqa: BLE001 - one section's failure is a row, not the run's end
            run_rows.append((f"section {name}", short_error(e)))
            log(f"section {name} failed: {short_error(e)}")
        run_rows.append((f"section {name}", f"ended at {elapsed():.0f} s"))
        table.write(args.table_out)
    if args.dump_autotune is not None:
        written = args.dump_autotune.exists()
        info.append(("autotune results", f"{args.dump_autotune}" if written else
                     f"none written to {args.dump_autotune} (no GPU autotuning on "
                     f"{jax.default_backend()})"))
    info.append(("wall time", f"{elapsed():.0f} s"))
    watchdog.cancel()
    table.write(args.table_out)
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
