"""The cost model's targets: ratio bounds against bf16 on the same chip and program, and
the verdicts that check one run's rows (`accelerator_cost.Cost`) against them."""

from __future__ import annotations

from bench.costmodel.accelerator_cost import Cost

__all__ = ["CALIBRATED_BOUNDS", "EMULATION_BOUNDS", "FP8_LAYER_BOUNDS", "FUSED_ATTENTION_BOUND",
           "VERDICT_POLICY", "calibrated_ratios", "calibrated_verdict", "emulation_verdict",
           "fp8_layer_verdict", "ratios"]

# The emulated mxfp4_all_h16 vs bf16: (target, program, metric) -> max ratio.
EMULATION_BOUNDS = {
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
# On the rates roofline, vs plain bf16 on the same chip and program:
# (target, program, policy) -> max ratio.
FP8_LAYER_BOUNDS = {
    ("h200", "layer_8b", "fp8"): 0.75,
    ("b200", "layer_8b", "fp8"): 0.70,
}
# Issue 47, on the calibrated model (bench/costmodel/calibrated.py), the 8B layer at seq 8192
# with fused attention: (target, program, policy, baseline policy) -> max ratio.
CALIBRATED_BOUNDS = {
    ("h200", "layer_8b", "fp8", "bf16"): 0.8,
    ("h200", "layer_8b", "mxfp4_all_h16@auto", "bf16"): 0.95,
    ("b200", "layer_8b", "fp8", "bf16"): 0.7,
    ("b200", "layer_8b", "mxfp4_all_h16@auto", "bf16"): 0.65,
    ("b200", "layer_8b", "mxfp4_all_h16@auto", "fp8"): 0.85,
}
# bf16 8B layer with fused attention vs the explicit-attention layer (rates roofline), and
# its temp memory, on H200.
FUSED_ATTENTION_BOUND = ("h200", "layer_8b", 0.6, 1.5e9)


def fp8_layer_verdict(costs: list[Cost]) -> str:
    """The fp8 8B-layer bounds and the fused-attention bound, checked on the rates
    roofline (default GPU GEMM variant): met, missed, or not compiled in this run."""
    def pick(target, prog, policy, attention=None):
        for c in costs:
            if (c.target, c.variant, c.program, c.policy) == (target, "", prog, policy) and (
                    attention is None or c.attention == attention):
                return c
        return None

    met, missed, absent = [], [], []
    for (target, prog, policy), bound in FP8_LAYER_BOUNDS.items():
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
    target, prog, bound, temp = FUSED_ATTENTION_BOUND
    fused, explicit = pick(target, prog, "bf16", "fused"), pick(target, prog, "bf16", "explicit")
    label = f"{target} {prog} bf16 fused vs explicit attention"
    if fused is None or explicit is None:
        absent.append(label)
    else:
        r = fused.rates_s / explicit.rates_s
        ok = r <= bound and fused.temp <= temp
        (met if ok else missed).append(
            f"{label} {r:.2f}x (<= {bound}x), temp {fused.temp / 1e9:.2f} GB (<= {temp / 1e9} GB)")
    parts = [f"met: {'; '.join(met) or 'none'}", f"MISSED: {'; '.join(missed) or 'none'}"]
    if absent:
        parts.append(f"not compiled in this run: {', '.join(absent)}")
    status = "all met" if not missed and not absent else "NOT met" if missed else "partial"
    return "verdict (fp8 layer targets, rates roofline): " + status + ". " + ". ".join(parts)


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


def emulation_verdict(costs: list[Cost], policy: str = VERDICT_POLICY) -> str:
    """The emulation's bounds (bytes, roofline, temp memory vs bf16): met, missed, or not
    compiled in this run."""
    met, missed, absent = [], [], []
    for (target, prog, metric), bound in EMULATION_BOUNDS.items():
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
    return f"verdict ({policy} vs bf16, emulation targets): {status}. " + ". ".join(parts)


def calibrated_ratios(costs: list[Cost]) -> list[tuple[tuple[str, str, str, str], float, float
                                                      | None]]:
    """Per CALIBRATED_BOUNDS entry: (key, bound, calibrated ratio or None when the run did not
    compile both rows with the same attention)."""
    out = []
    for key, bound in CALIBRATED_BOUNDS.items():
        target, prog, policy, base = key
        rows = [c for c in costs if (c.target, c.program) == (target, prog) and c.calibrated_s]
        pair = next(((c, b) for c in rows if c.policy == policy for b in rows
                     if b.policy == base and b.attention == c.attention
                     and b.variant == c.variant), None)
        out.append((key, bound, pair[0].calibrated_s / pair[1].calibrated_s if pair else None))
    return out


def calibrated_verdict(costs: list[Cost]) -> str:
    """Issue 47's targets on the calibrated model: met, missed, or not compiled in this run."""
    met, missed, absent = [], [], []
    for (target, prog, policy, base), bound, r in calibrated_ratios(costs):
        label = f"{target} {prog} {policy} vs {base}"
        if r is None:
            absent.append(label)
        else:
            (met if r <= bound else missed).append(f"{label} {r:.2f}x (<= {bound}x)")
    parts = [f"met: {'; '.join(met) or 'none'}", f"MISSED: {'; '.join(missed) or 'none'}"]
    if absent:
        parts.append(f"not compiled in this run: {', '.join(absent)}")
    status = "all met" if not missed and not absent else "NOT met" if missed else "partial"
    return "verdict (8B layer targets, calibrated model): " + status + ". " + ". ".join(parts)
