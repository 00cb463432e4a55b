"""The chip a program is compiled for: platform, device kind, compute capability.

The chip is the one a program is compiled for, not the machine that traces it:
:func:`target_chip` reads the target from the context mesh's abstract device
(``jax.set_mesh`` / ``jax.sharding.use_abstract_mesh`` with a mesh whose
``abstract_device`` names the chip, as a deviceless compile for a topology gives it,
and as Pallas' own GPU lowering reads it), else the local default device.
``target_chip(platform=...)`` answers for one lowering platform ('cpu', 'gpu',
'tpu'): the backend registry (`mxjax.backends`) asks once per platform and lets
``jax.lax.platform_dependent`` keep the branch of the platform lowered for.
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["PLATFORMS", "Chip", "compute_capability_of", "target_chip"]

# The lowering platforms a GEMM is resolved for (mxjax._platform.FORMS' order).
PLATFORMS = ("cpu", "gpu", "tpu")

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
        if self.platform not in PLATFORMS:
            raise ValueError(f"Chip.platform: expected one of {PLATFORMS}, got "
                             f"{self.platform!r}")

    @property
    def is_amd(self) -> bool:
        """An AMD GPU (ROCm device kinds: 'gfx...', 'AMD Instinct ...')."""
        low = self.device_kind.lower()
        return self.platform == "gpu" and ("gfx" in low or "instinct" in low
                                           or low.startswith("amd"))

    @property
    def native_fp4(self) -> bool:
        """Block-scaled FP4 matrix units: NVIDIA Blackwell (sm_100+), AMD MI355X (gfx950)."""
        cc, low = self.compute_capability, self.device_kind.lower()
        return bool((cc is not None and cc[0] >= 10)
                    or (self.is_amd and any(t in low for t in ("mi355", "mi350", "gfx950"))))

    @property
    def fp8_units(self) -> bool:
        """FP8 matrix units: NVIDIA sm_89+, AMD MI300 and later, or an FP4-capable part."""
        cc = self.compute_capability
        return bool(self.native_fp4 or (cc is not None and cc >= (8, 9))
                    or (self.is_amd and "mi3" in self.device_kind.lower()))


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
    if plat not in PLATFORMS:
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
    if want is not None and want not in PLATFORMS:
        raise ValueError(f"platform: expected one of {PLATFORMS} (or 'cuda', 'rocm'), got "
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
