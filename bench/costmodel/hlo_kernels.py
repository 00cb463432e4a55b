"""The kernels of an optimized (scheduled) HLO module, read from its text.

``kernels(text)`` lists what the program launches, in schedule order: each
instruction of the entry computation (and of computations it runs through
``while``/``call``/``conditional``, once each; a ``lax.cond``'s true branch only)
that does work on the device,
with its category, the bytes it reads and writes (the sizes of its operands
and results), GEMM flops, and the number of elementwise operations inside it.
Free instructions (parameters, constants, tuples, bitcasts, the ``-done``
halves of async pairs, optimization barriers) are not kernels.

The parser reads the text form that ``jax.stages.Compiled.as_text()`` prints
(XLA's HloModule::ToString). Layout suffixes, TPU tiling (``{1,0:T(8,128)}``)
and memory-space annotations are ignored: bytes are logical sizes.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import zlib

__all__ = ["Instruction", "Kernel", "gemm_operand_types", "kernels", "parse_module",
           "shape_bytes", "shape_elements"]

# Bits per element of each HLO primitive type that can appear in a shape.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e5m2": 8,
    "f8e4m3": 8, "f8e3m4": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
    "token": 0,
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_CALLS_RE = re.compile(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
# An indexed conditional names its branches branch_computations={...}, a predicate one
# (lax.cond) true_computation= / false_computation=.
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_PRED_BRANCHES_RE = re.compile(r"\b(true|false)_computation=%?([\w.\-]+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_KIND_RE = re.compile(r"\bkind=(\w+)")
_DIMS_RE = {k: re.compile(rf"\b{k}=\{{([0-9,]*)\}}") for k in (
    "lhs_contracting_dims", "lhs_batch_dims")}
_DIM_LABELS_RE = re.compile(r"\bdim_labels=([\w]+)_([\w]+)->([\w]+)")
_GEMM_CONFIG_RE = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')

# Instructions that launch nothing (views, bookkeeping, the second half of async pairs).
FREE_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
    "after-all", "add-dependency", "partition-id", "replica-id", "copy-done", "slice-done",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done", "recv-done",
    "async-done", "async-update", "domain",
})
# Opcodes that only move data (kernels of category 'copy').
COPY_OPCODES = frozenset({"copy", "copy-start", "transpose", "slice-start", "dynamic-slice",
                          "dynamic-update-slice", "concatenate", "pad", "slice", "reshape"})
# Fused ops that cost no arithmetic (index changes and plumbing).
_NO_ALU = frozenset({"parameter", "constant", "bitcast", "broadcast", "reshape", "slice",
                     "transpose", "tuple", "get-tuple-element", "concatenate", "pad", "iota",
                     "copy", "dynamic-slice", "dynamic-update-slice", "reverse"})
# Custom-call targets that are GEMMs (cuBLAS, cuBLASLt, cuDNN GEMMs and attention).
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$", "__cublas$lt$matmul$f8")
FMHA_TARGET = "__cudnn$fmha"  # cuDNN fused attention, forward and backward
BLOCK_SCALED_TARGET = "__cudnn$blockScaledDot"
# Custom calls that run GEMM kernels written in Pallas (Triton or Mosaic GPU lowering), by
# the name in their op_name metadata: name -> the rate class of the dots inside. Their
# flops are 2 M N K of the f32 [M, N] result and the packed-codes operand u8 [M, K/2].
PALLAS_GEMMS = {"mxfp4_matmul_fp8": "fp8", "mxfp4_matmul": "bf16"}
_FMHA_INTERMEDIATE_RE = re.compile(
    r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":\s*\[([^\]]*)\]')
_MASK_RE = re.compile(r'"mask_type":\s*"(\w+)"')


def _split_type(rest: str) -> tuple[str, str]:
    """('TYPE', 'remainder') from 'TYPE opcode(...)...' (TYPE may be a nested tuple)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
        raise ValueError(f"unbalanced tuple type: {rest[:80]!r}")
    # A layout may hold parentheses ({1,0:T(8,128)(2,1)}): the type ends at the first
    # space outside braces.
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == " " and depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def _split_call(rest: str) -> tuple[str, str, str]:
    """('opcode', 'operands', 'attributes') from 'opcode(operands), attributes'."""
    i = rest.index("(")
    opcode = rest[:i]
    depth = 0
    for j in range(i, len(rest)):
        depth += rest[j] == "("
        depth -= rest[j] == ")"
        if depth == 0:
            return opcode, rest[i + 1: j], rest[j + 1:]
    raise ValueError(f"unbalanced operand list: {rest[:80]!r}")


def shape_elements(shape: str) -> list[tuple[str, int]]:
    """(dtype, element count) of every array in an HLO shape string (tuples flattened)."""
    out = []
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype not in _BITS:
            continue
        out.append((dtype, math.prod(int(d) for d in dims.split(",") if d)))
    return out


def shape_bytes(shape: str) -> int:
    """Logical bytes of an HLO shape string (sub-byte types rounded up per array)."""
    return sum(-(-n * _BITS[dtype] // 8) for dtype, n in shape_elements(shape))


def _dims(shape: str) -> tuple[int, ...]:
    m = _ARRAY_RE.search(shape)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    is_root: bool

    @property
    def called(self) -> tuple[str, ...]:
        names = _CALLS_RE.findall(self.attributes)
        for group in _BRANCHES_RE.findall(self.attributes):
            names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
        names += [n for _, n in sorted(_PRED_BRANCHES_RE.findall(self.attributes),
                                       key=lambda m: m[0] != "true")]
        return tuple(names)

    @property
    def charged(self) -> tuple[str, ...]:
        """The computations a roofline charges this instruction's control flow for: a
        pred conditional's (``lax.cond``'s) true branch only, else every called one.

        mxjax's exact routes (``xla_fp8``) put their fast path in the true branch and
        fall back to the emulation in the false one, taken only when an operand's
        blocks span more than the route's window; the estimate is the fast path's.
        """
        true = [n for kind, n in _PRED_BRANCHES_RE.findall(self.attributes) if kind == "true"]
        return tuple(true) if true else self.called

    @property
    def custom_call_target(self) -> str:
        m = _TARGET_RE.search(self.attributes)
        return m.group(1) if m else ""

    @property
    def fusion_kind(self) -> str:
        m = _KIND_RE.search(self.attributes)
        return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, list[Instruction]]
    entry: str

    def shapes(self, computation: str) -> dict[str, str]:
        return {i.name: i.shape for i in self.computations[computation]}


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text, each a list of instructions in order."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER_RE.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _NAME_RE.match(line)
        if not m:
            continue
        shape, rest = _split_type(line[m.end():])
        opcode, operands, attributes = _split_call(rest)
        computations[current].append(Instruction(
            name=m.group(1), shape=shape, opcode=opcode,
            operands=tuple(_OPERAND_RE.findall(operands)), attributes=attributes,
            is_root=line.lstrip().startswith("ROOT")))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernel:
    """One kernel (or async copy/DMA) of the program.

    ``category``: 'gemm' (a dot/convolution fusion, a cuBLAS/cuDNN call or a bare
    dot), 'custom-call' (any other custom call: Pallas/Triton kernels, TPU custom
    calls), 'fusion' (other fusions), 'copy' (data movement only) or 'other'.
    ``alu_ops``: elementwise operations inside (sum over the fused instructions that
    compute something of their element counts; data movement and indexing free).
    """

    name: str
    opcode: str
    category: str
    target: str
    bytes_read: int
    bytes_written: int
    gemm_flops: int
    alu_ops: int
    shape: str
    fusion_kind: str = ""  # kLoop, kInput, kOutput, kCustom (fusions only)
    # (rate class, flops) of every GEMM inside (bench/costmodel/rates.py's classes: the operand
    # types); their flops sum to gemm_flops.
    gemms: tuple[tuple[str, int], ...] = ()
    # A custom call's operand shapes; for a fusion around a custom call (XLA fused its
    # operands' producers into a Pallas kernel: kCustom), the inner call's operands.
    call_operands: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _dot_flops(inst: Instruction, shapes: dict[str, str]) -> int:
    out = math.prod(_dims(inst.shape))  # the first array: a GEMM call's result, not workspace
    lhs = _dims(shapes.get(inst.operands[0], "")) if inst.operands else ()
    if inst.opcode == "custom-call":  # cuBLAS: dimension numbers in the backend config
        m = _GEMM_CONFIG_RE.search(inst.attributes)
        contract = [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()] if (
            m) else []
        return 2 * out * math.prod(lhs[d] for d in contract if d < len(lhs))
    if inst.opcode == "dot":
        m = _DIMS_RE["lhs_contracting_dims"].search(inst.attributes)
        contract = [int(d) for d in m.group(1).split(",") if d] if m else []
        return 2 * out * math.prod(lhs[d] for d in contract if d < len(lhs))
    m = _DIM_LABELS_RE.search(inst.attributes)  # convolution: 2 * out * lhs feature size
    if not m or not lhs:
        return 0
    labels = m.group(1)
    f = labels.index("f") if "f" in labels else None
    window = [lhs[i] for i, c in enumerate(labels) if c.isdigit() and i < len(lhs)]
    return 2 * out * (lhs[f] if f is not None and f < len(lhs) else 1) * (
        math.prod(window) if window and "window=" in inst.attributes else 1)


def _class(inst: Instruction, shapes: dict[str, str]) -> str:
    """The rate class (bench/costmodel/rates.py) of a GEMM from its first two operands' types."""
    from bench.costmodel.rates import rate_class

    ops = [_element_type(shapes.get(o, "")) for o in inst.operands[:2]]
    return rate_class(*(ops + ["f32"] * (2 - len(ops))))


def _fmha_flops(inst: Instruction, shapes: dict[str, str]) -> int:
    """Matrix flops of a cuDNN fused-attention call: per (batch, head) 2 Sq Sk D per GEMM,
    2 GEMMs forward (Q K^T, P V) and 5 backward (S recomputed, dV, dP, dQ, dK); half
    of it under a causal mask (the flash kernels skip masked tiles)."""
    m = _FMHA_INTERMEDIATE_RE.search(inst.attributes)
    q = _dims(shapes.get(inst.operands[0], "")) if inst.operands else ()
    if not m or not q:
        raise ValueError(f"{inst.name}: cannot read the attention's shape from its config")
    b, h, sq, sk = (int(d.strip().strip('"')) for d in m.group(1).split(","))
    gemms = 5 if "Backward" in inst.custom_call_target else 2
    mask = _MASK_RE.search(inst.attributes)
    causal = 0.5 if mask and "CAUSAL" in mask.group(1) else 1.0
    return int(gemms * 2 * b * h * sq * sk * q[-1] * causal)


TRITON_CALL_TARGETS = ("triton_kernel_call", "triton_kernel_call_ffi")  # jax-triton's
_OPAQUE_RE = re.compile(r'backend_config=\{opaque = "((?:[^"\\]|\\.)*)"')
# PTX of a Triton GEMM -> the rate class of its matrix instructions (the first match).
_PTX_CLASSES = ((rb"kind::mxf4", "fp4"), (rb"kind::f8f6f4", "fp8"), (rb"wgmma[^;]*\.e[45]m", "fp8"))


def _hlo_string_bytes(escaped: str) -> bytes:
    """The bytes of an HLO text string literal (C escapes and \\XX hex escapes)."""
    out, i = bytearray(), 0
    simple = {"n": b"\n", "t": b"\t", '"': b'"', "\\": b"\\", "'": b"'"}
    while i < len(escaped):
        if escaped[i] == "\\":
            if re.fullmatch(r"[0-9A-Fa-f]{2}", escaped[i + 1:i + 3]):
                out.append(int(escaped[i + 1:i + 3], 16))
                i += 3
                continue
            out += simple.get(escaped[i + 1], escaped[i + 1].encode())
            i += 2
            continue
        out += escaped[i].encode()
        i += 1
    return bytes(out)


def triton_call_ptx(inst: Instruction) -> bytes:
    """The PTX of a jax-triton kernel call (its backend config: a zlib-compressed proto
    holding the kernel's PTX text)."""
    m = _OPAQUE_RE.search(inst.attributes)
    if inst.custom_call_target not in TRITON_CALL_TARGETS or not m:
        raise ValueError(f"{inst.name}: not a jax-triton kernel call with its kernel")
    return zlib.decompress(_hlo_string_bytes(m.group(1)))


def _triton_gemm(inst: Instruction, shapes: dict[str, str]) -> tuple[tuple[str, int], ...]:
    """(rate class, flops) of the 'triton' backend's MXFP4 GEMM (jax-triton): f32[M, N] from
    u8[M, K/2] codes; its class from the PTX's matrix instructions (bf16 when none is an
    FP4/FP8 MMA: Hopper's dot_scaled upcasts to bf16 wgmma)."""
    m, n = _dims(inst.shape)[-2:]
    codes = [_dims(shapes.get(o, "")) for o in inst.operands
             if _element_type(shapes.get(o, "")) == "u8"]
    k = next((2 * d[1] for d in codes if len(d) == 2 and d[0] == m), None)
    if k is None:
        return ()
    ptx = triton_call_ptx(inst)
    cls = next((c for pattern, c in _PTX_CLASSES if re.search(pattern, ptx)), "bf16")
    return ((cls, 2 * m * n * k),)


def _custom_gemm(inst: Instruction, shapes: dict[str, str]) -> tuple[tuple[str, int], ...]:
    """(rate class, flops) of a GEMM custom call (cuBLAS, cuDNN) or a Pallas GEMM kernel."""
    target = inst.custom_call_target
    if target.startswith(FMHA_TARGET):
        return ((_class(inst, shapes), _fmha_flops(inst, shapes)),)
    if target == BLOCK_SCALED_TARGET:  # lhs [B, M, K], rhs [B, N, K] -> [B, M, N]
        lhs = _dims(shapes.get(inst.operands[0], ""))
        return ((_class(inst, shapes), 2 * math.prod(_dims(inst.shape)) * lhs[-1]),)
    if target.startswith(_GEMM_TARGETS):
        return ((_class(inst, shapes), _dot_flops(inst, shapes)),)
    if target in TRITON_CALL_TARGETS:
        return _triton_gemm(inst, shapes)
    name = _OP_NAME_RE.search(inst.attributes)
    parts = name.group(1).split("/") if name else []
    kernel = next((p for p in reversed(parts) if p in PALLAS_GEMMS), None)
    if kernel is None or not parts or parts[-1] != "pallas_call":
        return ()
    m, n = _dims(inst.shape)[-2:]
    codes = [_dims(shapes.get(o, "")) for o in inst.operands
             if _element_type(shapes.get(o, "")) == "u8"]
    k = next((2 * d[1] for d in codes if len(d) == 2 and d[0] == m), None)
    if k is None:
        raise ValueError(f"{inst.name}: Pallas GEMM {kernel!r} without a u8[{m}, K/2] operand")
    return ((PALLAS_GEMMS[kernel], 2 * m * n * k),)


def _fused_cost(module: Module, name: str, seen: frozenset = frozenset()
                ) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(GEMM flops, elementwise ops, (rate class, flops) per GEMM) of a fused/called
    computation, nested fusions included."""
    if name not in module.computations or name in seen:
        return 0, 0, ()
    shapes = module.shapes(name)
    flops = alu = 0
    gemms: list[tuple[str, int]] = []
    for inst in module.computations[name]:
        if inst.opcode in ("dot", "convolution"):
            f = _dot_flops(inst, shapes)
            flops += f
            gemms.append((_class(inst, shapes), f))
        elif inst.opcode in ("fusion", "call", "map"):
            for sub in inst.called:
                f, a, g = _fused_cost(module, sub, seen | {name})
                flops, alu = flops + f, alu + a
                gemms.extend(g)
        elif inst.opcode not in _NO_ALU:
            alu += sum(n for _, n in shape_elements(inst.shape))
    return flops, alu, tuple(gemms)


def _fused_custom_call(module: Module, inst: Instruction) -> Instruction | None:
    """The custom call a kCustom fusion wraps (producers fused into its operands), if any."""
    if inst.opcode != "fusion" or inst.fusion_kind != "kCustom" or not inst.called:
        return None
    calls = [i for i in module.computations.get(inst.called[0], ())
             if i.opcode == "custom-call" and not i.custom_call_target.startswith(_GEMM_TARGETS)]
    return calls[0] if len(calls) == 1 else None


def _category(inst: Instruction, flops: int) -> str:
    if inst.opcode == "custom-call":
        target = inst.custom_call_target
        return "gemm" if target.startswith(_GEMM_TARGETS) else "custom-call"
    if inst.opcode in ("dot", "convolution") or (inst.opcode == "fusion" and flops):
        return "gemm"
    if inst.opcode == "fusion":
        return "fusion"
    if inst.opcode in COPY_OPCODES:
        return "copy"
    return "other"


def _scheduled(module):
    """(instruction, its computation's shapes) in schedule order, through while/call/
    conditional bodies (which are not yielded themselves; a pred conditional's true
    branch only, `Instruction.charged`)."""

    def walk(computation: str, depth: int):
        if depth > 20:
            raise ValueError("control flow nested too deeply")
        shapes = module.shapes(computation)
        for inst in module.computations[computation]:
            if inst.opcode in ("while", "call", "conditional"):
                for sub in inst.charged:
                    yield from walk(sub, depth + 1)
            else:
                yield inst, shapes

    return walk(module.entry, 0)


def scheduled_instructions(text: str) -> list[Instruction]:
    """The instructions an optimized HLO module runs, in schedule order (called
    computations and conditional branches included)."""
    return [inst for inst, _ in _scheduled(parse_module(text))]


def kernels(text: str) -> list[Kernel]:
    """The kernels of an optimized HLO module's text, in schedule order (see module doc)."""
    module = parse_module(text)
    out: list[Kernel] = []
    for inst, shapes in _scheduled(module):
        if inst.opcode in FREE_OPCODES or inst.opcode.endswith("-done"):
            continue
        gemms: tuple[tuple[str, int], ...] = ()
        if inst.opcode == "fusion":
            flops, alu, gemms = _fused_cost(module, inst.called[0]) if inst.called else (
                0, 0, ())
        elif inst.opcode in ("dot", "convolution"):
            flops, alu = _dot_flops(inst, shapes), 0
            gemms = ((_class(inst, shapes), flops),)
        elif inst.opcode == "custom-call":
            gemms, alu = _custom_gemm(inst, shapes), 0
            flops = sum(f for _, f in gemms)
        else:
            flops, alu = 0, 0
        read = sum(shape_bytes(shapes.get(o, "")) for o in dict.fromkeys(inst.operands))
        written = shape_bytes(inst.shape)
        if (flops and inst.opcode == "custom-call" and inst.shape.startswith("(")
                and inst.custom_call_target.startswith(_GEMM_TARGETS)
                and not inst.custom_call_target.startswith(FMHA_TARGET)):
            written = shape_bytes(_ARRAY_RE.search(inst.shape).group(0))  # not workspace
        if inst.opcode.endswith("-start"):  # (operand, result, context): count one copy
            written = shape_bytes(shapes.get(inst.operands[0], "")) if inst.operands else 0
        category, target = _category(inst, flops), inst.custom_call_target
        call_operands = tuple(shapes.get(o, "") for o in inst.operands) if (
            inst.opcode == "custom-call") else ()
        inner = _fused_custom_call(module, inst)
        if inner is not None and not flops:
            inner_shapes = module.shapes(inst.called[0])
            category, target = "custom-call", inner.custom_call_target
            call_operands = tuple(inner_shapes.get(o, "") for o in inner.operands)
        out.append(Kernel(name=inst.name, opcode=inst.opcode, category=category,
                          target=target, bytes_read=read, bytes_written=written,
                          gemm_flops=flops, alu_ops=alu, shape=inst.shape,
                          fusion_kind=inst.fusion_kind, call_operands=call_operands,
                          gemms=gemms))
    return out


def count_by_category(ks: list[Kernel]) -> dict[str, int]:
    """Kernel counts per category (every category present, zeros included)."""
    counts = collections.Counter(k.category for k in ks)
    return {c: counts.get(c, 0) for c in ("fusion", "gemm", "custom-call", "copy", "other")}


def _element_type(shape: str) -> str:
    m = _ARRAY_RE.search(shape)
    return m.group(1) if m else ""


_OP_NAME_RE = re.compile(r'\bop_name="([^"]*)"')


def _op_name(inst: Instruction) -> str:
    m = _OP_NAME_RE.search(inst.attributes)
    return m.group(1) if m else ""


def _inner_dots(module: Module, name: str, seen: frozenset = frozenset()
                ) -> list[tuple[Instruction, dict[str, str]]]:
    """The dots (with their computation's shapes) inside a fused computation, nested ones too."""
    if name not in module.computations or name in seen:
        return []
    shapes = module.shapes(name)
    out = []
    for inst in module.computations[name]:
        if inst.opcode in ("dot", "convolution"):
            out.append((inst, shapes))
        elif inst.opcode in ("fusion", "call"):
            for sub in inst.called:
                out += _inner_dots(module, sub, seen | {name})
    return out


def gemm_operand_types(text: str) -> list[tuple[str, str, tuple[str, ...], str]]:
    """Every GEMM the program launches: ``(kernel name, how it runs, operand types, op_name)``.

    How it runs: the custom call's target (``__cublas$lt$matmul$f8``, ...) or
    ``'fusion'`` (a dot XLA fused, e.g. a Triton GEMM) or ``'dot'``. The types are
    those of the lhs and rhs the multiply itself reads: a fusion's inner dot's operands
    (an f8 input converted to bf16 inside the fusion counts as bf16), a custom call's
    first two operands. One entry per dot (a fusion holding two dots gives two).
    ``op_name``: the multiply's metadata op_name (JAX's scope, e.g.
    ``jit(step)/jvp()/jit(emulated_gemm)/...``), '' if it has none.
    """
    module = parse_module(text)
    out = []
    for inst, shapes in _scheduled(module):
        if inst.opcode == "custom-call" and inst.custom_call_target.startswith(_GEMM_TARGETS):
            types = tuple(_element_type(shapes.get(o, "")) for o in inst.operands[:2])
            out.append((inst.name, inst.custom_call_target, types, _op_name(inst)))
        elif inst.opcode in ("dot", "convolution"):
            types = tuple(_element_type(shapes.get(o, "")) for o in inst.operands[:2])
            out.append((inst.name, inst.opcode, types, _op_name(inst)))
        elif inst.opcode == "fusion" and inst.called:
            for dot, inner in _inner_dots(module, inst.called[0]):
                types = tuple(_element_type(inner.get(o, "")) for o in dot.operands[:2])
                out.append((inst.name, "fusion", types, _op_name(dot)))
    return out
