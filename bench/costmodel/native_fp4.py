"""mxjax's native MXFP4 GEMM kernels, and XLA's block-scaled dot, compiled deviceless for GPUs.

`compile_path` compiles one 4096^3 MXFP4 GEMM from packed operands (E2M1 codes two per
byte, E8M0 scales) for a GPU target along one of `PATHS` and reports whether it lowers (a
failure is a finding, with its first line), the kernels of the optimized program, and
which matrix instructions the kernel's PTX (or AMDGCN) holds where it is available
(`count_instructions`, `count_amd_instructions`). bench/native_fp4.py prints the table;
its docstring lists the paths.
"""

from __future__ import annotations

import dataclasses
import re

from bench.costmodel import aot
from bench.costmodel import hlo_kernels as hk

aot.use_cpu_host()

import jax
import jax.numpy as jnp

PATHS = ("triton", "triton_jax", "xla_scaled_dot", "xla_scaled_matmul")
DEFAULT_TARGETS = ("b200", "h200")
# PTX patterns: (label, regex).
INSTRUCTIONS = (
    ("tcgen05.mma", r"\btcgen05\.mma\b"),
    ("tcgen05 block-scaled", r"tcgen05\.mma[^\n;]*(block_scale|mxf4|mxf8f6f4)"),
    ("kind::mxf4*", r"kind::mxf4"),
    ("kind::mxf8f6f4", r"kind::mxf8f6f4"),
    ("wgmma.mma_async", r"\bwgmma\.mma_async\b"),
    ("mma.sync", r"\bmma\.sync\b"),
    ("cvt e2m1", r"\bcvt\.[^\n;]*e2m1"),
    ("e4m3 operands", r"\.e4m3\b"),
)
_COMPUTE_CAPABILITY = {"b200": 100, "h200": 90, "h100": 90}
# AMD targets -> HIP architecture (wavefront 64). Compiled by Triton's AMD backend only.
AMD_TARGETS = {"mi355x": "gfx950", "mi300x": "gfx942"}
# AMDGCN patterns: (label, regex). cbsz/blgp give the A/B formats; 4 is E2M1.
AMD_INSTRUCTIONS = (
    ("v_mfma_scale 32x32x64", r"\bv_mfma_scale_f32_32x32x64_f8f6f4\b"),
    ("v_mfma_scale 16x16x128", r"\bv_mfma_scale_f32_16x16x128_f8f6f4\b"),
    ("e2m1 x e2m1 (cbsz:4 blgp:4)", r"\bv_mfma_scale_\w+[^\n]*\bcbsz:4 blgp:4\b"),
    ("other v_mfma", r"\bv_mfma_(?!scale_)\w+"),
)
_AMD_NOT_TRIED = ("not tried: XLA's deviceless ROCm compile needs the ROCm runtime "
                  "libraries (docs/PERFORMANCE.md, 'MI355X (gfx950), deviceless')")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    target: str
    path: str
    ok: bool
    error: str
    kernels: tuple[str, ...]  # custom-call targets / GEMM categories of the optimized program
    instructions: dict[str, int] | None  # None: no PTX / AMDGCN to read


def _packed(m: int, n: int, k: int):
    u8 = jnp.uint8
    return (jax.ShapeDtypeStruct((m, k // 2), u8), jax.ShapeDtypeStruct((m, k // 32), u8),
            jax.ShapeDtypeStruct((k // 2, n), u8), jax.ShapeDtypeStruct((k // 32, n), u8))


def _program(path: str, size: int, target: str):
    """(fn, abstract args) of one GEMM along `path`."""
    m = n = k = size
    if path == "triton_jax":
        import jax_triton as jt

        from mxjax.kernels import triton_gemm

        def fn(*a):
            plan = triton_gemm.launch_plan(*a)
            out = jt.triton_call(*plan.args, kernel=triton_gemm._kernel(),
                                 out_type=jax.ShapeDtypeStruct(plan.out_shape, jnp.float32),
                                 grid=plan.grid, num_warps=8, num_stages=3,
                                 compute_capability=_COMPUTE_CAPABILITY[target],
                                 backend_options={"ptx_version": triton_gemm.PTX_VERSION},
                                 **plan.constants)
            return out[:m, :n]

        return fn, _packed(m, n, k)
    if path == "xla_scaled_dot":
        configs = [jax.nn.get_scaled_dot_general_config("mxfp4")] * 2

        def fn(a, b):
            return jax.nn.scaled_dot_general(a, b, (((1,), (0,)), ((), ())), configs=configs)

        bf = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        return fn, (bf, jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    if path == "xla_scaled_matmul":
        def fn(a, b, sa, sb):
            return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)

        f4, e8 = jnp.float4_e2m1fn, jnp.float8_e8m0fnu
        return fn, (jax.ShapeDtypeStruct((1, m, k), f4), jax.ShapeDtypeStruct((1, n, k), f4),
                    jax.ShapeDtypeStruct((1, m, k // 32), e8),
                    jax.ShapeDtypeStruct((1, n, k // 32), e8))
    raise ValueError(f"path: unknown {path!r}; expected one of {PATHS}")


def count_instructions(ptx: str) -> dict[str, int]:
    return {label: len(re.findall(rx, ptx)) for label, rx in INSTRUCTIONS}


def count_amd_instructions(amdgcn: str) -> dict[str, int]:
    return {label: len(re.findall(rx, amdgcn)) for label, rx in AMD_INSTRUCTIONS}


def amd_unavailable_reason() -> str | None:
    """None if Triton's AMD backend can compile here, else why not."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'mxjax[aot-gpu]')"
    if importlib.util.find_spec("triton.backends.amd") is None:
        return "this triton has no AMD backend (triton.backends.amd)"
    return None


def _short(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def _triton_compile(gpu_target, size: int):
    """The 'triton' backend's kernel at `size`^3, compiled by Triton for `gpu_target`
    (a ``triton.backends.compiler.GPUTarget``) with the launch options it runs with."""
    import triton
    from triton.compiler import ASTSource

    from mxjax.kernels import triton_gemm

    plan = triton_gemm.launch_plan(*[jnp.zeros(s.shape, s.dtype)
                                     for s in _packed(size, size, size)])
    signature = {"a_ptr": "*u8", "sa_ptr": "*u8", "b_ptr": "*u8", "sb_ptr": "*u8",
                 "c_ptr": "*fp32", **{name: "constexpr" for name in plan.constants}}
    src = ASTSource(fn=triton_gemm._kernel(), signature=signature, constexprs=plan.constants)
    return triton.compile(src, target=gpu_target, options={"num_warps": 8, "num_stages": 3})


def triton_ptx(target: str, size: int) -> str:
    """PTX of the 'triton' backend's kernel for `target`, compiled by Triton itself."""
    from triton.backends.compiler import GPUTarget

    return _triton_compile(GPUTarget("cuda", _COMPUTE_CAPABILITY[target], 32), size).asm["ptx"]


def triton_amdgcn(target: str, size: int) -> str:
    """AMDGCN assembly of the 'triton' backend's kernel for the AMD `target` (a key of
    AMD_TARGETS), compiled by Triton's AMD backend without a GPU."""
    from triton.backends.compiler import GPUTarget

    if target not in AMD_TARGETS:
        raise ValueError(f"target: {target!r} is not an AMD target; expected one of "
                         f"{sorted(AMD_TARGETS)}")
    return _triton_compile(GPUTarget("hip", AMD_TARGETS[target], 64), size).asm["amdgcn"]


def _kernel_names(compiled) -> tuple[str, ...]:
    """GEMM and custom-call kernels: their targets, or category:name (fusion kind for GEMMs)."""
    out = []
    for k in hk.kernels(compiled.as_text()):
        if k.category == "custom-call":
            out.append(k.target)
        elif k.category == "gemm":
            loop = " (kLoop: XLA's elemental dot, no GEMM library)" if (
                k.fusion_kind == "kLoop") else ""
            out.append(k.target or f"gemm {k.name}{loop}")
    n_other = sum(1 for k in hk.kernels(compiled.as_text())
                  if k.category not in ("gemm", "custom-call"))
    return tuple(out) + ((f"+{n_other} other kernels",) if n_other else ())


def compile_path(target: str, path: str, size: int) -> Result:
    if target in AMD_TARGETS:
        if path != "triton":
            return Result(target=target, path=path, ok=False, error=_AMD_NOT_TRIED, kernels=(),
                          instructions=None)
        try:
            asm = triton_amdgcn(target, size)
        except Exception as e:  # noqa: BLE001 - a path that does not lower is a finding
            return Result(target=target, path=path, ok=False, error=_short(e), kernels=(),
                          instructions=None)
        return Result(target=target, path=path, ok=True, error="",
                      kernels=("triton (own compile)",),
                      instructions=count_amd_instructions(asm))
    try:
        if path == "triton":
            ptx = triton_ptx(target, size)
            return Result(target=target, path=path, ok=True, error="",
                          kernels=("triton (own compile)",),
                          instructions=count_instructions(ptx))
        fn, args = _program(path, size, target)
        compiled = aot.compile_for(fn, args, target)
    except Exception as e:  # noqa: BLE001 - a path that does not lower is a finding
        return Result(target=target, path=path, ok=False, error=_short(e), kernels=(),
                      instructions=None)
    return Result(target=target, path=path, ok=True, error="", kernels=_kernel_names(compiled),
                  instructions=None)
