"""What a GPU executes, from an XLA dump: threads launched, PTX and SASS instructions.

A deviceless GPU compile with `dump_options` (``xla_dump_to``, and
``xla_dump_emitter_re`` matching the PTX emitter only: ``.*`` dumps every emitter's
passes too and made the 8B layer's compile 6x slower) writes each module's PTX and the
thunk sequence (every kernel launch with its grid and block). From those, per kernel:
the threads it launches, the instructions in its PTX entry and the SASS instructions
ptxas makes of them (Triton's NVIDIA backend ships ptxas and cuobjdump). Counts are
static: straight-line kernels execute each instruction once per thread; a loop or
divergent branch is counted once, so read those as a floor.

`triton_call_seconds` charges the Triton custom calls of a compiled program (Pallas'
Triton kernels) by their SASS: threads x instructions at one instruction per f32 lane
per clock, the arithmetic bound the rates roofline's bytes do not see.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import subprocess
from pathlib import Path

__all__ = ["TRITON_CALL", "KernelResources", "dump_options", "launches", "parse_ptxas_info",
           "ptx_kernels", "ptxas_resources", "sass_kernels", "triton_call_seconds"]

TRITON_CALL = "__gpu$xla.gpu.triton"
_LAUNCH_RE = re.compile(
    r"\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]")
# An instruction line of cuobjdump's SASS: its address (4 hex digits, more past 64 KB).
_SASS_LINE = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+\S")
_PTXAS_FUNCTION = re.compile(r"Function properties for (\w+)")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def dump_options(dump: Path | str) -> dict[str, str]:
    """XLA compiler options that dump the PTX and thunk sequence this module reads."""
    return {"xla_dump_to": str(dump), "xla_dump_emitter_re": "ptx"}


def launches(dump: Path) -> dict[str, tuple[tuple[int, int, int], int]]:
    """kernel name -> (grid, threads launched) from the dump's thunk sequences."""
    out = {}
    for f in dump.glob("*thunk_sequence.txt"):
        for line in f.read_text().splitlines():
            m = _LAUNCH_RE.search(line)
            if m:
                g = [int(m[i]) for i in range(2, 8)]
                out[m[1]] = ((g[0], g[1], g[2]), g[0] * g[1] * g[2] * g[3] * g[4] * g[5])
    return out


def ptx_kernels(dump: Path) -> dict[str, tuple[int, int]]:
    """kernel name -> (threads launched, PTX instructions in its entry) from an XLA dump."""
    threads = {name: n for name, (_, n) in launches(dump).items()}
    out = {}
    for f in dump.glob("*.ptx"):
        for m in re.finditer(r"\.entry (\w+)\((.*?)\n\}\n", f.read_text(), re.DOTALL):
            count = collections.Counter()
            for line in m[2].splitlines():
                s = line.strip()
                if not s or s.startswith((".", "//", "{", "}", ")")) or s.endswith(":"):
                    continue
                op = s.split()[1] if s.startswith("@") else s.split()[0]
                if not op.startswith(("ld.param", "cvta", "griddepcontrol", "ret")):
                    count[op] += 1
            out[m[1]] = (threads.get(m[1], 0), sum(count.values()))
    return out


def _nvidia_tool(name: str) -> Path:
    """A CUDA binary Triton's NVIDIA backend ships (the AOT venv has no CUDA toolkit)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name}: not in Triton's NVIDIA backend ({path.parent}); "
                                "install triton (the AOT venv has it)")
    return path


def _sass_counts(cubin: Path) -> dict[str, int]:
    sass = subprocess.run([str(_nvidia_tool("cuobjdump")), "-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    out, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\w+)", line)
        if m:
            name = m[1]
            out[name] = 0
        elif name is not None and _SASS_LINE.match(line):
            out[name] += 1
    return out


def sass_kernels(dump: Path, prefixes: tuple[str, ...] | None = None) -> dict[str, int]:
    """kernel name -> SASS instructions in its function: each dumped PTX module (those with
    an entry named by one of ``prefixes``, or all) assembled for the architecture it names
    (``.target``) by the ptxas Triton ships for Blackwell (CUDA 13, which reads the PTX 9
    XLA writes) and read back by cuobjdump."""
    ptxas = _nvidia_tool("ptxas-blackwell")
    out = {}
    for f in sorted(dump.glob("*.ptx")):
        text = f.read_text()
        arch = re.search(r"^\.target (\w+)", text, re.MULTILINE)
        if arch is None or (prefixes is not None and not any(
                f".entry {p}" in text for p in prefixes)):
            continue
        cubin = f.with_suffix(".sass.cubin")
        subprocess.run([str(ptxas), f"-arch={arch[1]}", str(f), "-o", str(cubin)],
                       check=True, capture_output=True)
        out.update(_sass_counts(cubin))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelResources:
    """What ptxas made of one kernel: registers per thread, local-memory spill bytes per
    thread (stores, loads) and SASS instructions (static)."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    sass: int


def parse_ptxas_info(text: str) -> dict[str, tuple[int, int, int]]:
    """kernel -> (registers, spill store bytes, spill load bytes) from ``ptxas -v`` output."""
    out, name, spills = {}, None, (0, 0)
    for line in text.splitlines():
        if m := _PTXAS_FUNCTION.search(line):
            name, spills = m[1], (0, 0)
        elif (m := _PTXAS_SPILLS.search(line)) and name:
            spills = (int(m[1]), int(m[2]))
        elif (m := _PTXAS_REGISTERS.search(line)) and name:
            out[name] = (int(m[1]),) + spills
    return out


def ptxas_resources(dump: Path, prefixes: tuple[str, ...]) -> dict[str, KernelResources]:
    """kernel name -> its registers, spills and SASS count, for the dumped PTX modules with an
    entry named by one of ``prefixes`` (Triton kernels: XLA's own fusions are not read),
    assembled as in `sass_kernels` with ``ptxas -v``."""
    ptxas = _nvidia_tool("ptxas-blackwell")
    out = {}
    for f in sorted(dump.glob("*.ptx")):
        text = f.read_text()
        arch = re.search(r"^\.target (\w+)", text, re.MULTILINE)
        if arch is None or not any(f".entry {p}" in text for p in prefixes):
            continue
        cubin = f.with_suffix(".sass.cubin")
        info = subprocess.run([str(ptxas), "-v", f"-arch={arch[1]}", str(f), "-o", str(cubin)],
                              check=True, capture_output=True, text=True)
        sass = _sass_counts(cubin)
        for name, (regs, stores, loads) in parse_ptxas_info(info.stdout + info.stderr).items():
            out[name] = KernelResources(registers=regs, spill_store_bytes=stores,
                                        spill_load_bytes=loads, sass=sass.get(name, 0))
    return out


def _triton_calls(hlo_text: str) -> list[tuple[str, str, tuple[int, int, int]]]:
    """(HLO name, Triton kernel name, grid) of each Triton custom call."""
    calls = []
    for line in hlo_text.splitlines():
        if f'custom_call_target="{TRITON_CALL}"' not in line:
            continue
        hlo = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        name = re.search(r'\bname = "(\w+)"', line)
        grid = [re.search(rf"grid_{a} = (\d+)", line) for a in "xyz"]
        if hlo:  # a call without a kernel name or grid matches nothing: reported unmatched
            calls.append((hlo[1], name[1] if name else "",
                          tuple(int(g[1]) for g in grid) if all(grid) else ()))
    return calls


def triton_call_seconds(hlo_text: str, dump: Path, alu_ops_per_s: float
                        ) -> tuple[dict[str, float], list[str]]:
    """Seconds per Triton custom call of a compiled program at its SASS instruction count.

    A call is matched to the dump's kernels by its Triton kernel name (XLA suffixes
    ``__N`` to repeats) and grid; the largest count among matches is taken (calls of one
    name and grid are the same kernel up to XLA's renaming).

    Returns:
      ({HLO name: threads x SASS instructions / alu_ops_per_s}, the HLO names of calls
      matched to no kernel of the dump: charged nothing, to be reported).
    """
    calls = _triton_calls(hlo_text)
    if not calls:
        return {}, []
    grids = launches(dump)
    sass = sass_kernels(dump, tuple(sorted({name for _, name, _ in calls if name})))
    by_key: dict[tuple[str, tuple[int, int, int]], float] = {}
    for entry, (grid, threads) in grids.items():
        if entry in sass:
            key = (re.sub(r"__\d+$", "", entry), grid)
            by_key[key] = max(by_key.get(key, 0.0), threads * sass[entry] / alu_ops_per_s)
    seconds, unmatched = {}, []
    for hlo, name, grid in calls:
        if (name, grid) in by_key:
            seconds[hlo] = by_key[(name, grid)]
        else:
            unmatched.append(hlo)
    return seconds, unmatched
