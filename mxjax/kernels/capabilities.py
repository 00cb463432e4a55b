"""What a chip can run: platform, device, compute capability, kernels.

The chip is the one a program is compiled for, not the machine that traces it:
``capabilities()`` reads the target from the context mesh's abstract device
(``jax.set_mesh`` / ``jax.sharding.use_abstract_mesh`` with a mesh whose
``abstract_device`` names the chip, as a deviceless compile for a topology gives
it, and as Pallas' own GPU lowering reads it), else the local default device.
``capabilities(platform=...)`` answers for one lowering platform ('cpu', 'gpu',
'tpu'): the GEMM dispatcher asks once per platform and lets
``jax.lax.platform_dependent`` keep the branch of the platform lowered for.
``capabilities_for`` is the pure function of a described chip (tests, tables).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax

from mxjax.kernels import triton_gemm
from mxjax.recipes import BACKENDS

__all__ = ["KERNEL_BACKENDS", "Capabilities", "Chip", "capabilities", "capabilities_for",
           "compute_capability_of", "target_chip"]

# Every concrete backend (all of mxjax.recipes.BACKENDS but 'auto').
KERNEL_BACKENDS = tuple(b for b in BACKENDS if b != "auto")
_PLATFORMS = ("cpu", "gpu", "tpu")

# NVIDIA device kinds -> compute capability, for targets known only by their kind (an
# abstract device carries no compute capability). Source: NVIDIA's CUDA GPU list
# (developer.nvidia.com/cuda-gpus). Longest match first: 'GB200' before 'B200'.
_NVIDIA_CC = (
    ("GB300", (10, 3)), ("B300", (10, 3)), ("GB200", (10, 0)), ("B200", (10, 0)),
    ("B100", (10, 0)), ("GH200", (9, 0)), ("H200", (9, 0)), ("H100", (9, 0)),
    ("H800", (9, 0)), ("H20", (9, 0)), ("L40", (8, 9)), ("L4", (8, 9)),
    ("RTX 6000 Ada", (8, 9)), ("RTX 4090", (8, 9)), ("A100", (8, 0)), ("A800", (8, 0)),
    ("A30", (8, 0)), ("A10", (8, 6)), ("A40", (8, 6)), ("RTX 3090", (8, 6)),
    ("T4", (7, 5)), ("V100", (7, 0)),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """A chip a program is compiled for.

    Attributes:
      platform: 'cpu', 'gpu' or 'tpu' (ROCm and CUDA are both 'gpu').
      device_kind: e.g. 'NVIDIA H200', 'TPU v5 lite', 'cpu'; '' when unknown (a GPU
        lowering with no GPU target in sight).
      compute_capability: (major, minor) of an NVIDIA GPU, else None.
    """

    platform: str
    device_kind: str
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self):
        if self.platform not in _PLATFORMS:
            raise ValueError(f"Chip.platform: expected one of {_PLATFORMS}, got "
                             f"{self.platform!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What one chip's kernels can do.

    Attributes:
      platform: 'cpu', 'gpu' or 'tpu'.
      device_kind: e.g. 'NVIDIA H200', 'cpu' ('' for an unknown GPU).
      compute_capability: (major, minor) on NVIDIA GPUs, else None.
      native_fp4: the device has block-scaled FP4 matrix units (Blackwell sm_100+,
        AMD MI355X / gfx950).
      fp8_tensor_cores: FP8 matrix units (sm_89+, or an FP4-capable part).
      pallas_mode: 'triton' (compiled, GPU), 'interpret' (CPU) or None (cannot run).
      jax_triton: jax_triton and triton are importable.
      backends: (name, reason) pairs; reason is '' when the backend can run here.
    """

    platform: str
    device_kind: str
    compute_capability: tuple[int, int] | None
    native_fp4: bool
    fp8_tensor_cores: bool
    pallas_mode: str | None
    jax_triton: bool
    backends: tuple[tuple[str, str], ...]

    def can_run(self, backend: str) -> bool:
        return self.reason(backend) == ""

    def reason(self, backend: str) -> str:
        """'' if `backend` can run here, else why not."""
        for name, why in self.backends:
            if name == backend:
                return why
        raise ValueError(f"backend: unknown {backend!r}; expected one of {KERNEL_BACKENDS}")

    @property
    def runnable(self) -> tuple[str, ...]:
        return tuple(name for name, why in self.backends if not why)


def _parse_cc(cc) -> tuple[int, int] | None:
    if not isinstance(cc, str) or "." not in cc:
        return None
    major, minor = cc.split(".", 1)
    try:
        return int(major), int(minor)
    except ValueError:
        return None


def compute_capability_of(device_kind: str) -> tuple[int, int] | None:
    """The compute capability of an NVIDIA device kind ('NVIDIA H200 141GB HBM3e' ->
    (9, 0)), or None when the kind is not NVIDIA's or not in the table."""
    kind = device_kind.upper()
    if "NVIDIA" not in kind and not any(name in kind for name, _ in _NVIDIA_CC):
        return None
    for name, cc in _NVIDIA_CC:
        if name.upper() in kind:
            return cc
    return None


def _platform_of(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _local_chip(platform: str | None) -> Chip | None:
    """The first local device of `platform` (None: the default backend's), if any."""
    try:
        devs = jax.devices() if platform is None else jax.devices(platform)
    except RuntimeError:  # no backend of that platform here
        return None
    if not devs:
        return None
    dev = devs[0]
    plat = _platform_of(dev.platform)
    if plat not in _PLATFORMS:
        return None
    kind = str(getattr(dev, "device_kind", plat))
    cc = _parse_cc(getattr(dev, "compute_capability", None)) if plat == "gpu" else None
    if plat == "gpu" and cc is None:
        cc = compute_capability_of(kind)
    return Chip(platform=plat, device_kind=kind, compute_capability=cc)


def target_chip(platform: str | None = None) -> Chip:
    """The chip a program traced now is compiled for, on lowering `platform`.

    The context mesh's abstract device when one is set (its device kind names the
    target; a local device of the same kind supplies its compute capability), else
    a local device of the platform (the default one when `platform` is None). A GPU
    lowering with neither gives ``Chip(platform='gpu', device_kind='')``: an unknown
    GPU, on which only the XLA emulation is chosen.
    """
    want = None if platform is None else _platform_of(platform)
    if want is not None and want not in _PLATFORMS:
        raise ValueError(f"platform: expected one of {_PLATFORMS} (or 'cuda', 'rocm'), got "
                         f"{platform!r}")
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        plat = _platform_of(abstract.platform)
        if want is None or plat == want:
            local = _local_chip(plat)
            if local is not None and local.device_kind == abstract.device_kind:
                return local
            cc = compute_capability_of(abstract.device_kind) if plat == "gpu" else None
            return Chip(platform=plat, device_kind=abstract.device_kind, compute_capability=cc)
    if want is None:
        local = _local_chip(None)
        return local if local is not None else Chip(platform="cpu", device_kind="cpu")
    if want == "cpu":
        return Chip(platform="cpu", device_kind="cpu")
    local = _local_chip(want)
    if local is not None:
        return local
    return Chip(platform=want, device_kind="")


def capabilities_for(chip: Chip) -> Capabilities:
    """What the kernels can do on `chip` (a pure function of the chip and the installed
    packages)."""
    platform, kind, cc = chip.platform, chip.device_kind, chip.compute_capability
    low = kind.lower()
    is_amd = platform == "gpu" and ("gfx" in low or "instinct" in low or low.startswith("amd"))
    native_fp4 = bool(
        (cc is not None and cc[0] >= 10)
        or (is_amd and any(t in low for t in ("mi355", "mi350", "gfx950")))
    )
    fp8 = bool(native_fp4 or (cc is not None and cc >= (8, 9)) or (is_amd and "mi3" in low))
    has_jt = all(importlib.util.find_spec(m) is not None for m in ("triton", "jax_triton"))

    pallas_mode = {"gpu": "triton", "cpu": "interpret"}.get(platform)
    reasons: dict[str, str] = {"xla": ""}
    # XLA's FP8 GEMM: FP8 matrix units on the GPU; XLA:CPU computes f8 dots exactly (tests).
    if platform == "cpu" or (platform == "gpu" and fp8 and not is_amd):
        reasons["xla_fp8"] = ""
    elif platform == "gpu" and not kind:
        reasons["xla_fp8"] = ("no GPU target known (trace under jax.set_mesh / "
                              "jax.sharding.use_abstract_mesh with the target's abstract "
                              "device, or on the GPU)")
    else:
        reasons["xla_fp8"] = (f"needs FP8 matrix units with XLA FP8 GEMMs (NVIDIA sm_89+); "
                              f"device is {kind!r}")
    # XLA's block-scaled dot: cuDNN's FP4 MMA on Blackwell; XLA:CPU expands it (tests).
    if platform == "cpu" or (platform == "gpu" and not is_amd and cc is not None
                             and cc >= (10, 0)):
        reasons["xla_fp4"] = ""
    else:
        reasons["xla_fp4"] = (f"needs block-scaled FP4 MMA reached by XLA (cuDNN, NVIDIA "
                              f"Blackwell sm_100+); device is {kind or 'unknown'!r}"
                              + (" (an unknown GPU: trace under the target's abstract mesh)"
                                 if platform == "gpu" and not kind else ""))
    if pallas_mode is None:
        reasons["pallas"] = ("the Pallas kernels target Triton (GPU) or the interpreter (CPU), "
                             f"not {platform}")
    elif platform == "gpu" and not kind:
        reasons["pallas"] = ("no GPU target known (trace under jax.set_mesh / "
                             "jax.sharding.use_abstract_mesh with the target's abstract device, "
                             "or on the GPU)")
    elif is_amd:
        reasons["pallas"] = f"the Pallas GEMM kernels are built for NVIDIA GPUs, not {kind!r}"
    else:
        reasons["pallas"] = ""
    if reasons["pallas"]:
        reasons["pallas_fp8"] = reasons["pallas"]
    elif pallas_mode == "interpret" or fp8:
        reasons["pallas_fp8"] = ""  # interpret: FP8 dot emulated exactly in f32
    else:
        reasons["pallas_fp8"] = (f"needs FP8 tensor cores (NVIDIA sm_89+); device is {kind!r} "
                                 f"cc={cc}")
    if platform != "gpu":
        reasons["triton"] = f"needs a GPU target (compiling for {platform!r})"
    elif reasons["pallas"]:
        reasons["triton"] = reasons["pallas"]
    else:
        reasons["triton"] = triton_gemm.unavailable_reason(platform) or ""
    return Capabilities(
        platform=platform,
        device_kind=kind,
        compute_capability=cc,
        native_fp4=native_fp4,
        fp8_tensor_cores=fp8,
        pallas_mode=pallas_mode,
        jax_triton=has_jt,
        backends=tuple((b, reasons[b]) for b in KERNEL_BACKENDS),
    )


def capabilities(platform: str | None = None) -> Capabilities:
    """What the kernels can do on the chip compiled for (:func:`target_chip`), on lowering
    `platform` ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'; None: the target's own platform)."""
    return capabilities_for(target_chip(platform))
