"""The layer8b section: one Llama 3.1-8B decoder layer's train step under each row
(POLICY[@BACKEND][/ATTENTION][?]), compiled, then timed in interleaved rounds."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings

import jax

from bench.device.harness import SKIPPED, Pace, Sizes, Table, elapsed, log, short_error

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


def _layer_program(row: LayerRow, sz: Sizes):
    """(fn, abstract args, description) of the 8B layer's train step for `row`."""
    from bench.costmodel import programs
    from mxjax import policies

    policy = policies.get(row.preset)
    if row.backend is not None:
        policy = policy.with_backend(row.backend)  # ValueError naming an unknown one
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
    from bench.costmodel import programs

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
            note = (f"program: {what} (bench/costmodel/programs.py layer_program); GEMM "
                    "backend '-': the preset's own; ms: median of the interleaved rounds, one "
                    "call per row per round; rows marked ? were compiled after the others were "
                    "timed, then all were timed in further rounds")
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
