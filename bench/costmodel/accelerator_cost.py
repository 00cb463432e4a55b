"""Cost of one program compiled deviceless for a GPU, TPU or CPU target: one row (`Cost`).

`compile_one` builds a program of `bench.costmodel.programs`, compiles it ahead of time
(`bench.costmodel.aot`) and `measure`s the optimized HLO: kernels (fusions, GEMMs, custom
calls, copies), bytes read + written by all kernels, ``memory_analysis`` temp bytes, on TPU
XLA's ``optimal_seconds``, a peak-efficiency roofline (`roofline`, `ASSUMPTIONS`) and the
rates roofline (`rates_roofline`: each kernel at its chip's published rate,
`bench.costmodel.rates`). bench/accelerator_cost.py prints the rows as tables.

GPU compiles run without a device: no GEMM autotuning (XLA's placeholder Triton tiles),
so a GPU target is compiled with XLA's default Triton GEMMs or with cuBLAS (variant
``cublas``: ``xla_gpu_enable_triton_gemm=false``). Fusion structure and elementwise bytes
are the real compiler's. The GPU bytes are the sum of every kernel's operand and result
sizes; the TPU bytes are XLA's own ``bytes accessed`` (its ``optimal_seconds`` subtracts
1 s per custom call; the count is added back here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.costmodel import aot, calibrated, ptx_cost
from bench.costmodel import hlo_kernels as hk
from bench.costmodel import rates as R
from bench.costmodel.programs import LAYER_8B_SEQ, program

aot.use_cpu_host()

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
    "type's rate (bench/costmodel/rates.py). '+alu' (GPU) also bounds each kernel by its "
    "arithmetic at one instruction per f32 lane per clock: fusions by their HLO elementwise "
    "ops, Triton calls (Pallas kernels) by threads x the SASS instructions ptxas makes of "
    "their PTX (static counts, bench/costmodel/ptx_cost.py); '*': Triton calls whose SASS was "
    "not found, uncharged.")
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
    # The calibrated model (bench/costmodel/calibrated.py; GPUs with published rates): device
    # seconds, and per kernel class (class, kernels, seconds).
    calibrated_s: float = 0.0
    calibrated_by_class: tuple[tuple[str, int, float], ...] = ()
    # The kernels it charges most: (name, class, seconds, bytes, shape, why), slowest first.
    calibrated_top: tuple[tuple[str, str, float, int, str, str], ...] = ()
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
    `bench.costmodel.ptx_cost.triton_call_seconds`), at one op per f32 lane per clock.
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
    from which Triton calls are charged their arithmetic (`bench.costmodel.ptx_cost`)."""
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
    calibrated_s, by_class, calibrated_top = 0.0, (), ()
    if target.kind == "gpu" and xla_dump is not None:
        alu_s, unmatched = ptx_cost.triton_call_seconds(text, xla_dump, target.alu_ops_per_s)
        if target.name in R.CHIP_RATES:
            rates = calibrated.rates_for(target.name)
            counts = calibrated.counts_from_dump(text, xla_dump)
            calibrated_s = calibrated.program_seconds(ks, counts, rates)
            by_class = tuple((c, n, t) for c, (n, t) in
                             calibrated.seconds_by_class(ks, counts, rates).items() if n)
            calibrated_top = tuple(
                (k.name, cls, t, k.bytes, k.shape[:70], why) for t, cls, k, why in
                calibrated.slowest_kernels(ks, counts, rates, TOP_KERNELS))
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
                attention=attention, calibrated_s=calibrated_s, calibrated_by_class=by_class,
                calibrated_top=calibrated_top)


class KernelCycles:
    """Static cycles of TPU kernel specs, measured in a subprocess
    (bench/costmodel/tpu_kernel_cycles.py)."""

    def __init__(self):
        self.cycles: dict[tuple[str, str], int] = {}
        self.clock: dict[str, float] = {}

    def __call__(self, target: aot.Target, specs):
        from bench.costmodel import tpu_kernel_cycles as tkc

        todo = {json.dumps(tkc.spec_to_json(s), sort_keys=True) for s in specs}
        todo = sorted(j for j in todo if (target.name, j) not in self.cycles)
        if todo or target.name not in self.clock:
            proc = subprocess.run(
                [sys.executable, str(Path(tkc.__file__)), target.name],
                input="[" + ",".join(todo) + "]", capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(
                    f"bench/costmodel/tpu_kernel_cycles.py failed: {proc.stderr[-2000:]}")
            result = json.loads(proc.stdout)
            self.clock[target.name] = result["clock_hz"]
            for j, c in zip(todo, result["cycles"]):
                self.cycles[(target.name, j)] = c

        def cycles_of(spec) -> int:
            return self.cycles[(target.name, json.dumps(tkc.spec_to_json(spec), sort_keys=True))]

        return cycles_of, self.clock[target.name]


def compile_one(target: aot.Target, variant: str, prog: str, policy: str, args,
                kernel_cycles: KernelCycles | None = None, attention: str = "") -> Cost:
    """One compile and its row. ``policy``: a preset name or 'peer:<name>'
    (bench/costmodel/peers.py); ``attention``: the layers' LlamaConfig.attention_impl
    ('' = the config default)."""
    try:
        from mxjax.emulation.in_place_tpu import record_kernels
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
