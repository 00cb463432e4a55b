"""What GPU and TPU compilers make of the emulated GEMMs, from deviceless compiles on this CPU.

For each target (``--targets``: h100, h200, v5e, v6e, cpu; b200 too) and program
(``--programs``: ``matmul``, value_and_grad of one 4096^3 bf16 matmul; ``layer``,
the Llama-3.2-1B decoder layer's train step of ``bench/export_shape.py``, batch
1 x seq 2048; on request ``wrapped_mlp``, a Flax MLP under ``mxjax.nn.wrap``,
``bench/programs.py``) under ``bf16`` and every MXFP4/NVFP4/FP8 preset, prints one row:
kernels (fusions, GEMMs, custom calls, copies), bytes read + written by all
kernels, ``memory_analysis`` temp bytes, on TPU XLA's ``optimal_seconds``, and
a roofline step-time estimate (its assumptions are printed with the table),
each also as a ratio to ``bf16`` compiled in the same run. The last line is the
verdict against issue 22's targets for ``mxfp4_all_h16``.

    pip install -e '.[train,aot-tpu,aot-gpu]'   # libtpu and the CUDA PJRT plugin (~1.1 GB)
    python bench/accelerator_cost.py                          # everything (~1 h on 2 cores)
    python bench/accelerator_cost.py --targets h200,v5e --programs matmul \\
        --policies bf16,mxfp4_all_h16

GPU compiles run without a device: no GEMM autotuning (XLA's placeholder Triton
tiles), so each GPU target is compiled twice, with XLA's default Triton GEMMs
and with cuBLAS (``xla_gpu_enable_triton_gemm=false``; row ``<gpu>/cublas``).
Fusion structure and elementwise bytes are the real compiler's. The GPU bytes
are the sum of every kernel's operand and result sizes; the TPU bytes are
XLA's own ``bytes accessed`` (its ``optimal_seconds`` subtracts 1 s per custom
call; the count is added back here).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("PYTHONPATH") and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # with PYTHONPATH set, that checkout's mxjax (a before table)

from bench import aot, ptx_cost
from bench import hlo_kernels as hk
from bench import rates as R
from bench.programs import EXTRA_PROGRAMS, LAYER_8B_SEQ, PROGRAMS, program

aot.use_cpu_host()

import jax

DEFAULT_TARGETS = ("h100", "h200", "v5e", "v6e", "cpu")
GEMM_EFFICIENCY = 0.70  # of the bf16 matrix peak, for GEMM kernels
HBM_EFFICIENCY = 0.85  # of peak HBM bandwidth, for every kernel's bytes
LAUNCH_S = 2e-6  # per kernel (GPU), per fusion/custom call (TPU)
ASSUMPTIONS = (
    f"roofline (assumptions, not measurements): per kernel max(bytes / ({HBM_EFFICIENCY:.0%} of "
    f"peak HBM bandwidth), GEMM flops / ({GEMM_EFFICIENCY:.0%} of the bf16 matrix peak)) + "
    f"{LAUNCH_S * 1e6:.0f} us launch, summed in schedule order (no overlap); '+alu' also bounds "
    "each kernel by its elementwise ops at one op per f32 lane per clock (GPU). Peaks: GPU from "
    "XLA's target spec (bf16 = matrix units x 2 flops per FMA); TPU v5e 197 TFLOP/s, 819 GB/s, "
    "v6e 918 TFLOP/s, 1640 GB/s (published). Copies and fusions on TPU are kernels too."
)
# Issue 22's targets (mxfp4_all_h16 emulated vs bf16): (target, program, metric) -> max ratio.
TARGETS_22 = {
    ("h200", "matmul", "bytes"): 3.0,
    ("h200", "layer", "bytes"): 1.4,
    ("h200", "layer", "roofline"): 1.3,
    ("v5e", "layer", "bytes"): 1.5,
    ("v5e", "layer", "optimal_s"): 1.3,
    ("v5e", "matmul", "optimal_s"): 1.5,
    ("cpu", "layer", "temp"): 1.25,
    ("h200", "layer", "temp"): 1.25,
    ("v5e", "layer", "temp"): 1.25,
}
VERDICT_POLICY = "mxfp4_all_h16"
RATES_ASSUMPTIONS = (
    "rates roofline (assumptions, not measurements): per kernel max(sum over its GEMMs of "
    "flops / the chip's published dense peak for the GEMM's operand types, bytes / peak HBM "
    f"bandwidth) + {R.LAUNCH_S * 1e6:.0f} us launch, summed in schedule order (no overlap, "
    "100% of every peak). GEMMs: XLA dots and fusions containing dots (operand types of the "
    "dot), cuBLAS/cuBLASLt calls (operands 0 and 1), cuDNN block-scaled dots (lhs [B, M, K]), "
    "cuDNN fused attention (2 Sq Sk D per batch and head per GEMM, 2 GEMMs forward, 5 "
    "backward, x0.5 under a causal mask), mxjax's Pallas GEMM kernels "
    f"({', '.join(f'{k}: {v}' for k, v in hk.PALLAS_GEMMS.items())}). Every other kernel, "
    "Pallas quantize kernels included, is charged by its bytes (TPU Pallas kernels: at least "
    "libtpu's static cycles). A GEMM type without units on a chip runs at the next wider "
    "type's rate (bench/rates.py). '+alu' (GPU) also bounds each kernel by its arithmetic at "
    "one instruction per f32 lane per clock: fusions by their HLO elementwise ops, Triton "
    "calls (Pallas kernels) by threads x the SASS instructions ptxas makes of their "
    "PTX (static counts, bench/ptx_cost.py); '*': Triton calls whose SASS was not found, "
    "uncharged.")
# Issue 35's targets on the rates roofline, vs plain bf16 on the same chip and program:
# (target, program, policy) -> max ratio.
TARGETS_35 = {
    ("h200", "layer_8b", "fp8"): 0.75,
    ("b200", "layer_8b", "fp8"): 0.70,
}
# bf16 8B layer with fused attention vs the explicit-attention layer (rates roofline), and
# its temp memory, on H200.
FUSED_ATTENTION_TARGET = ("h200", "layer_8b", 0.6, 1.5e9)
TOP_KERNELS = 40  # kept per program (printed with --top)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cost:
    """One compiled program on one target."""

    target: str
    variant: str  # '' or 'cublas'
    program: str
    policy: str
    kernels: dict[str, int]
    bytes: int  # kernels' operands + results (GPU, CPU); XLA's bytes accessed (TPU)
    temp: int
    optimal_s: float | None  # TPU only, custom calls added back
    roofline_s: float
    roofline_alu_s: float
    gemm_flops: int
    rates_s: float = 0.0  # the rates roofline (RATES_ASSUMPTIONS)
    rates_alu_s: float = 0.0  # the same, each kernel also bounded by its arithmetic (GPU)
    alu_unmatched: int = 0  # Triton calls whose SASS was not found: no arithmetic charged
    flops_by_class: tuple[tuple[str, int], ...] = ()  # GEMM flops per rate class
    attention: str = ""  # the LlamaConfig attention_impl asked for ('' = its default)
    compile_s: float
    top: tuple[tuple[str, str, float, int, str], ...] = ()  # (name, category, s, bytes, shape)

    @property
    def row_target(self) -> str:
        return f"{self.target}/{self.variant}" if self.variant else self.target

    @property
    def row_program(self) -> str:
        return f"{self.program}@{self.attention}" if self.attention else self.program

    @property
    def n_kernels(self) -> int:
        return sum(self.kernels.values())


def roofline(ks: list[hk.Kernel], target: aot.Target,
             kernel_s: dict[str, float] | None = None) -> tuple[float, float]:
    """(seconds, seconds with the ALU bound) of a kernel list under ASSUMPTIONS.

    ``kernel_s``: a time estimate per custom call (TPU kernels' static cycles),
    bounding them from below like GEMM flops do.
    """
    if target.kind == "cpu":
        return 0.0, 0.0
    bw = HBM_EFFICIENCY * target.hbm_bytes_per_s
    peak = GEMM_EFFICIENCY * target.bf16_flops_per_s
    kernel_s = kernel_s or {}
    plain = with_alu = 0.0
    for k in ks:
        t = max(k.bytes / bw, k.gemm_flops / peak, kernel_s.get(k.name, 0.0))
        plain += t + LAUNCH_S
        alu = k.alu_ops / target.alu_ops_per_s if target.alu_ops_per_s else 0.0
        with_alu += max(t, alu) + LAUNCH_S
    return plain, with_alu


def rates_roofline(ks: list[hk.Kernel], target: aot.Target,
                   kernel_s: dict[str, float] | None = None,
                   alu_s: dict[str, float] | None = None) -> float:
    """Seconds of a kernel list under RATES_ASSUMPTIONS (0 for the CPU).

    ``alu_s``: when given, each kernel is also bounded by its arithmetic: a fusion by
    its HLO elementwise ops, a Triton call by ``alu_s[name]`` (its SASS,
    `bench.ptx_cost.triton_call_seconds`), at one op per f32 lane per clock.
    """
    if target.kind == "cpu":
        return 0.0
    chip = R.rates_for(target.name)
    kernel_s = kernel_s or {}
    total = 0.0
    for k in ks:
        gemm = sum(f / chip.rate(cls)[0] for cls, f in k.gemms)
        t = max(gemm, k.bytes / chip.hbm_bytes_per_s, kernel_s.get(k.name, 0.0))
        if alu_s is not None and target.alu_ops_per_s:
            t = max(t, k.alu_ops / target.alu_ops_per_s, alu_s.get(k.name, 0.0))
        total += t + R.LAUNCH_S
    return total


def flops_by_class(ks: list[hk.Kernel]) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for k in ks:
        for cls, f in k.gemms:
            out[cls] = out.get(cls, 0) + f
    return tuple(sorted(out.items(), key=lambda kv: R.RATE_ORDER.index(kv[0])))


PALLAS_TPU_TARGET = "tpu_custom_call"


def _tpu_kernel_seconds(ks: list[hk.Kernel], specs, cycles_of, clock_hz) -> dict:
    """Seconds per Pallas TPU kernel of a program: its traced spec's static cycles / clock.

    A compiled kernel is matched to the traced specs by its input (shape, dtype) and
    number of inputs (signs, uniforms); specs that XLA merged (CSE) match the same
    kernel. The largest estimate among matching specs is taken. A kernel into which
    XLA fused its input's producer (a kCustom fusion) is matched by the kernel's own
    operands and gets the kernel's cycles alone: XLA's ``optimal_seconds`` already
    charges such a fusion the time of its producer, as if it were materialized (the
    sum assumes no overlap of the two: an upper bound).
    """
    if not specs:
        return {}
    by_key: dict[tuple, float] = {}
    for spec in specs:
        dims = (spec.a, spec.k) if spec.b == 1 else (spec.a, spec.k, spec.b)
        key = (dims, spec.dtype, 1 + spec.has_signs + spec.has_uniforms)
        by_key[key] = max(by_key.get(key, 0.0), cycles_of(spec) / clock_hz)
    out = {}
    for k in ks:
        if k.target != PALLAS_TPU_TARGET or not k.call_operands:
            continue
        (dt, _), = hk.shape_elements(k.call_operands[0])[:1]
        dims = hk._dims(k.call_operands[0])
        key = (dims, {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}.get(dt, dt),
               len(k.call_operands))
        if key not in by_key:
            raise RuntimeError(f"TPU kernel {k.name} ({key}) matches no traced kernel spec")
        out[k.name] = by_key[key]
    return out


def measure(compiled, target: aot.Target, variant: str, program: str, policy: str,
            compile_s: float, dump: Path | None = None, kernel_specs=(),
            kernel_cycles=None, attention: str = "", xla_dump: Path | None = None) -> Cost:
    """One program's row. ``xla_dump``: XLA's dump of a GPU compile (PTX, thunk sequence),
    from which Triton calls are charged their arithmetic (`bench.ptx_cost`)."""
    text = compiled.as_text()
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        tag = (f"{target.name}{'_' + variant if variant else ''}_{program}"
               f"{'_' + attention if attention else ''}_{policy.replace(':', '_')}")
        (dump / f"{tag}.hlo.txt").write_text(text)
    ks = hk.kernels(text)
    kernel_s = {}
    if target.kind == "tpu" and any(k.target == PALLAS_TPU_TARGET for k in ks):
        cycles_of, clock = kernel_cycles(target, kernel_specs)
        kernel_s = _tpu_kernel_seconds(ks, kernel_specs, cycles_of, clock)
    plain, with_alu = roofline(ks, target, kernel_s)
    alu_s, unmatched = {}, []
    if target.kind == "gpu" and xla_dump is not None:
        alu_s, unmatched = ptx_cost.triton_call_seconds(text, xla_dump, target.alu_ops_per_s)
    top = ()
    if target.kind != "cpu":  # the slowest kernels under the rates roofline
        timed = sorted(((k.name, k.category, rates_roofline([k], target, kernel_s) - R.LAUNCH_S,
                         k.bytes, k.shape[:70]) for k in ks), key=lambda r: -r[2])
        top = tuple(timed[:TOP_KERNELS])
    total_bytes = sum(k.bytes for k in ks)
    optimal = None
    if target.kind == "tpu":
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        # XLA's totals leave Pallas kernels out: their operands and results are added,
        # and their static-profile time. Other custom calls cost -1 s each in
        # optimal_seconds: added back.
        pallas = [k for k in ks if k.target == PALLAS_TPU_TARGET]
        total_bytes = int(ca.get("bytes accessed", 0)) + sum(
            k.bytes for k in pallas if k.opcode == "custom-call")  # fusions: XLA counts them
        others = sum(1 for k in ks if k.opcode == "custom-call" and k not in pallas)
        optimal = (float(ca.get("optimal_seconds", float("nan"))) + others
                   + sum(kernel_s.values()))
    mem = compiled.memory_analysis()
    return Cost(target=target.name, variant=variant, program=program, policy=policy,
                kernels=hk.count_by_category(ks), bytes=total_bytes,
                temp=int(mem.temp_size_in_bytes), optimal_s=optimal, roofline_s=plain,
                roofline_alu_s=with_alu, gemm_flops=sum(k.gemm_flops for k in ks),
                compile_s=compile_s, top=top, rates_s=rates_roofline(ks, target, kernel_s),
                rates_alu_s=rates_roofline(ks, target, kernel_s, alu_s),
                alu_unmatched=len(unmatched), flops_by_class=flops_by_class(ks),
                attention=attention)


class KernelCycles:
    """Static cycles of TPU kernel specs, measured in a subprocess (bench/tpu_kernel_cycles.py)."""

    def __init__(self):
        self.cycles: dict[tuple[str, str], int] = {}
        self.clock: dict[str, float] = {}

    def __call__(self, target: aot.Target, specs):
        from bench import tpu_kernel_cycles as tkc

        todo = {json.dumps(tkc.spec_to_json(s), sort_keys=True) for s in specs}
        todo = sorted(j for j in todo if (target.name, j) not in self.cycles)
        if todo or target.name not in self.clock:
            proc = subprocess.run(
                [sys.executable, str(Path(tkc.__file__)), target.name],
                input="[" + ",".join(todo) + "]", capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(f"bench/tpu_kernel_cycles.py failed: {proc.stderr[-2000:]}")
            result = json.loads(proc.stdout)
            self.clock[target.name] = result["clock_hz"]
            for j, c in zip(todo, result["cycles"]):
                self.cycles[(target.name, j)] = c

        def cycles_of(spec) -> int:
            return self.cycles[(target.name, json.dumps(tkc.spec_to_json(spec), sort_keys=True))]

        return cycles_of, self.clock[target.name]


def compile_one(target: aot.Target, variant: str, prog: str, policy: str, args,
                kernel_cycles: KernelCycles | None = None, attention: str = "") -> Cost:
    """One compile and its row. ``policy``: a preset name or 'peer:<name>' (bench/peers.py);
    ``attention``: the layers' LlamaConfig.attention_impl ('' = the config default)."""
    try:
        from mxjax.routes.in_place_tpu import record_kernels
    except ImportError:  # an mxjax without TPU kernels (a before table)
        record_kernels = functools.partial(contextlib.nullcontext, ())

    fn, fargs = program(prog, policy, matmul_size=args.matmul_size, batch=args.batch,
                        seq=args.seq, seq_8b=getattr(args, "seq_8b", LAYER_8B_SEQ),
                        attention_impl=attention or None)
    options = {"xla_gpu_enable_triton_gemm": False} if variant == "cublas" else {}
    if target.kind == "gpu" and args.autotune_results:
        options["xla_gpu_load_autotune_results_from"] = str(args.autotune_results)
    with tempfile.TemporaryDirectory(prefix="accelerator_cost_") as xla_dump:
        if target.kind == "gpu":  # PTX and launches: the Triton calls' SASS
            options |= ptx_cost.dump_options(xla_dump)
        t0 = time.perf_counter()
        with record_kernels() as specs:
            compiled = aot.compile_for(fn, fargs, target, options)
        compile_s = time.perf_counter() - t0
        return measure(compiled, target, variant, prog, policy, compile_s, args.dump,
                       kernel_specs=specs, kernel_cycles=kernel_cycles or KernelCycles(),
                       attention=attention,
                       xla_dump=Path(xla_dump) if target.kind == "gpu" else None)


# --------------------------------------------------------------------------- #
# Tables and verdict
# --------------------------------------------------------------------------- #
def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def table(costs: list[Cost]) -> list[str]:
    """One block per (target row, program): a row per policy with ratios to bf16."""
    header = ("policy", "kernels (fus/gemm/cc/copy)", "GB", "x", "temp GB", "x", "opt ms", "x",
              "roofline ms", "x", "+alu ms", "x")
    lines: list[str] = []
    groups: dict[tuple[str, str], list[Cost]] = {}
    for c in costs:
        groups.setdefault((c.row_target, c.row_program), []).append(c)
    for (row_target, prog), group in groups.items():
        base = next((c for c in group if c.policy == "bf16"), None)
        rows = [header]
        for c in group:
            k = c.kernels
            rows.append((
                c.policy,
                f"{c.n_kernels} ({k['fusion']}/{k['gemm']}/{k['custom-call']}/{k['copy']})",
                _gb(c.bytes), _ratio(c.bytes, base and base.bytes),
                _gb(c.temp), _ratio(c.temp, base and base.temp),
                _ms(c.optimal_s), _ratio(c.optimal_s, base and base.optimal_s),
                _ms(c.roofline_s or None), _ratio(c.roofline_s, base and base.roofline_s),
                _ms(c.roofline_alu_s or None),
                _ratio(c.roofline_alu_s, base and base.roofline_alu_s)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines.append(f"## {row_target}, {prog}")
        for j, r in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
            if j == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def _by_class(c: Cost) -> str:
    total = sum(f for _, f in c.flops_by_class)
    if not total:
        return "-"
    return " ".join(f"{cls} {f / total:.0%}" for cls, f in c.flops_by_class)


def rates_table(costs: list[Cost]) -> list[str]:
    """One block per (chip, program): the rates roofline per policy, its ratio to bf16 of
    the same block, the same with each kernel bounded by its arithmetic too ('+alu':
    fusions by their HLO elementwise ops, Triton calls by their SASS; a '*' marks Triton
    calls left uncharged), the GEMM flops by operand type, temp memory and kernel count."""
    header = ("policy", "rates ms", "x bf16", "+alu ms", "x bf16", "GEMM TFLOP",
              "GEMM flops by type", "temp GB", "kernels", "GB moved")
    lines: list[str] = []
    groups: dict[tuple[str, str], list[Cost]] = {}
    for c in costs:
        if c.rates_s:
            groups.setdefault((c.row_target, c.row_program), []).append(c)
    for (row_target, prog), group in groups.items():
        base = next((c for c in group if c.policy == "bf16"), None)
        rows = [header]
        for c in group:
            alu = _ms(c.rates_alu_s or None) + ("*" if c.alu_unmatched else "")
            rows.append((c.policy, _ms(c.rates_s), _ratio(c.rates_s, base and base.rates_s),
                         alu, _ratio(c.rates_alu_s or None, base and base.rates_alu_s or None),
                         f"{c.gemm_flops / 1e12:.2f}", _by_class(c), _gb(c.temp),
                         str(c.n_kernels), _gb(c.bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines.append(f"## rates roofline: {row_target}, {prog}")
        for j, r in enumerate(rows):
            lines.append("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)))
            if j == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def verdict_35(costs: list[Cost]) -> str:
    """Issue 35's targets on the rates roofline (default GPU GEMM variant)."""
    def pick(target, prog, policy, attention=None):
        for c in costs:
            if (c.target, c.variant, c.program, c.policy) == (target, "", prog, policy) and (
                    attention is None or c.attention == attention):
                return c
        return None

    met, missed, absent = [], [], []
    for (target, prog, policy), bound in TARGETS_35.items():
        attentions = sorted({c.attention for c in costs
                             if c.program == prog and c.policy == policy}) or [""]
        for att in attentions:
            c, b = pick(target, prog, policy, att), pick(target, prog, "bf16", att)
            label = f"{target} {prog}{'@' + att if att else ''} {policy}"
            if c is None or b is None or not b.rates_s:
                absent.append(label)
                continue
            r = c.rates_s / b.rates_s
            (met if r <= bound else missed).append(f"{label} {r:.2f}x (<= {bound}x)")
    target, prog, bound, temp = FUSED_ATTENTION_TARGET
    fused, explicit = pick(target, prog, "bf16", "fused"), pick(target, prog, "bf16", "explicit")
    label = f"{target} {prog} bf16 fused vs explicit attention"
    if fused is None or explicit is None:
        absent.append(label)
    else:
        r = fused.rates_s / explicit.rates_s
        ok = r <= bound and fused.temp <= temp
        (met if ok else missed).append(
            f"{label} {r:.2f}x (<= {bound}x), temp {_gb(fused.temp)} GB (<= {temp / 1e9} GB)")
    parts = [f"met: {'; '.join(met) or 'none'}", f"MISSED: {'; '.join(missed) or 'none'}"]
    if absent:
        parts.append(f"not compiled in this run: {', '.join(absent)}")
    status = "all met" if not missed and not absent else "NOT met" if missed else "partial"
    return "verdict (issue 35 targets, rates roofline): " + status + ". " + ". ".join(parts)


def ratios(costs: list[Cost], target: str, prog: str, policy: str) -> dict[str, float] | None:
    """Metric ratios of `policy` to bf16 for (target, default variant, program), or None."""
    rows = [c for c in costs if c.target == target and not c.variant and c.program == prog]
    pair = next(((c, b) for c in rows if c.policy == policy for b in rows
                 if b.policy == "bf16" and b.attention == c.attention), None)
    if pair is None:  # policy and bf16 compiled with the same attention
        return None
    c, b = pair
    out = {"bytes": c.bytes / b.bytes, "roofline": c.roofline_s / b.roofline_s if b.roofline_s
           else float("nan"), "temp": c.temp / b.temp if b.temp else float("nan")}
    if c.optimal_s is not None and b.optimal_s:
        out["optimal_s"] = c.optimal_s / b.optimal_s
    return out


def verdict(costs: list[Cost], policy: str = VERDICT_POLICY) -> str:
    met, missed, absent = [], [], []
    for (target, prog, metric), bound in TARGETS_22.items():
        r = ratios(costs, target, prog, policy)
        label = f"{target} {prog} {metric}"
        if r is None or metric not in r:
            absent.append(label)
            continue
        value = r[metric]
        (met if value <= bound else missed).append(f"{label} {value:.2f}x (<= {bound}x)")
    parts = [f"met: {'; '.join(met) or 'none'}", f"MISSED: {'; '.join(missed) or 'none'}"]
    if absent:
        parts.append(f"not compiled in this run: {', '.join(absent)}")
    status = "all met" if not missed and not absent else "NOT met" if missed else "partial"
    return f"verdict ({policy} vs bf16, issue 22 targets): {status}. " + ". ".join(parts)


def main(argv=None) -> int:
    from mxjax import policies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help=f"comma list of {sorted(aot.TARGETS)}")
    ap.add_argument("--programs", default=",".join(PROGRAMS),
                    help=f"comma list of {list(PROGRAMS + EXTRA_PROGRAMS)}")
    ap.add_argument("--policies", default=",".join(policies.names()))
    ap.add_argument("--gpu-gemm", default="triton,cublas",
                    help="GPU GEMM variants: 'triton' (XLA's default), 'cublas' (triton off)")
    ap.add_argument("--matmul-size", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048, help="the 1B layer's and the MLP's")
    ap.add_argument("--seq-8b", type=int, default=LAYER_8B_SEQ, help="the 8B layer's")
    ap.add_argument("--attention", default="fused",
                    help="comma list of LlamaConfig.attention_impl values for the layers "
                         "(each a separate program; '' = the config's default, explicit)")
    ap.add_argument("--attention-baseline", default="explicit",
                    help="also compile each layer's bf16 train step with this attention_impl "
                         "(issue 35's fused-attention target; '' = none)")
    ap.add_argument("--peers", default="",
                    help="comma list of bench/peers.py peers compiled beside the presets "
                         "(flax_fp8, jax_mxfp8, jax_nvfp4, jax_mxfp4, qwix_fp8); a peer that "
                         "cannot be built here is reported and skipped")
    ap.add_argument("--dump", type=Path, default=None, help="write each optimized HLO here")
    ap.add_argument("--autotune-results", type=Path, default=None,
                    help="GPU compiles load XLA's autotune results from this file "
                         "(written on a device by bench/gpu.py --dump-autotune)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("--top", type=int, default=0,
                    help=f"print each program's N slowest kernels (rates roofline; N <= "
                         f"{TOP_KERNELS})")
    args = ap.parse_args(argv)

    import mxjax

    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "bf16" not in names:
        names.insert(0, "bf16")
    for n in names:
        policies.get(n)  # unknown names fail before any compile
    from bench import peers as peer_mod

    for p in (x.strip() for x in args.peers.split(",") if x.strip()):
        why = peer_mod.unavailable_reason(p)
        if why:
            print(f"# peer {p}: skipped: {why}", flush=True)
        else:
            names.append(f"peer:{p}")
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()] or [""]
    baseline = args.attention_baseline.strip()
    targets = [aot.TARGETS[t.strip()] for t in args.targets.split(",") if t.strip()]
    variants_gpu = [v.strip() for v in args.gpu_gemm.split(",") if v.strip()]
    for v in variants_gpu:
        if v not in ("triton", "cublas"):
            raise SystemExit(f"--gpu-gemm: unknown variant {v!r}; expected triton, cublas")
    progs = [p.strip() for p in args.programs.split(",") if p.strip()]
    for p in progs:
        if p not in PROGRAMS + EXTRA_PROGRAMS:
            raise SystemExit(f"--programs: unknown {p!r}; expected some of "
                             f"{PROGRAMS + EXTRA_PROGRAMS}")
    print(f"jax {jax.__version__}; mxjax from {Path(mxjax.__file__).parent}; deviceless compiles "
          f"on {jax.default_backend()}", flush=True)
    costs: list[Cost] = []
    kernel_cycles = KernelCycles()
    t_start = time.perf_counter()
    for target in targets:
        why = aot.unavailable_reason(target)
        if why:
            print(f"# {target.name}: skipped: {why}", flush=True)
            continue
        variants = [("" if v == "triton" else v) for v in variants_gpu] if (
            target.kind == "gpu") else [""]
        for variant in variants:
            for prog, attention in ((p, a) for p in progs for a in (
                    attentions + ([baseline] if baseline and baseline not in attentions else [])
                    if p.startswith("layer") else [""])):
                for name in (names if attention in attentions or not prog.startswith("layer")
                             else ["bf16"]):
                    try:
                        c = compile_one(target, variant, prog, name, args, kernel_cycles,
                                        attention=attention)
                    except Exception as e:  # one failed compile is a row, not the run's end
                        if not name.startswith("peer:"):
                            raise
                        print(f"  FAILED   {target.name} {prog} {name}: {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
                        continue
                    costs.append(c)
                    if args.json:  # after every compile: a long run that stops keeps its rows
                        args.json.write_text(json.dumps([dataclasses.asdict(x) for x in costs],
                                                        indent=1))
                    print(f"  compiled {c.row_target:12s} {c.row_program:8s} {name:18s} "
                          f"{c.compile_s:6.1f}s: {c.n_kernels} kernels, {_gb(c.bytes)} GB, "
                          f"rates {_ms(c.rates_s)} ms", flush=True)
    print()
    for line in table(costs):
        print(line)
    if args.top:
        for c in costs:
            print(f"## slowest kernels: {c.row_target}, {c.program}, {c.policy}")
            for name, cat, s, b, shape in c.top[: args.top]:
                print(f"  {s * 1e6:9.1f} us  {b / 1e6:9.1f} MB  {cat:11s} {name}  {shape}")
    print()
    for line in rates_table(costs):
        print(line)
    print()
    print(ASSUMPTIONS)
    print(RATES_ASSUMPTIONS)
    for t in targets:
        if t.kind != "cpu" and t.name in R.CHIP_RATES:
            print("rates: " + R.rates_for(t.name).summary())
    compile_times = [c.compile_s for c in costs]
    if compile_times:
        print(f"{len(costs)} compiles, median {statistics.median(compile_times):.1f}s, total "
              f"{time.perf_counter() - t_start:.0f}s")
    print(verdict(costs))
    print(verdict_35(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
