"""How much device memory a run needs: `estimate(...) -> MemoryEstimate`, and what fits.

An estimate from the shapes alone (nothing is compiled), per device, of the four parts of a
train step's memory:

* parameters: fp32 master weights, split over ``fsdp`` (the embedding axis) and ``tensor``
  (heads, MLP and vocabulary axes) where the sizes divide, as `models.sharding` lays them;
* optimizer state: AdamW's two fp32 moments per parameter, laid out like the parameters;
* gradients: one fp32 copy of the parameters, two with gradient accumulation (the
  accumulator and the micro-batch's gradient);
* activations: what the backward pass keeps per token of the micro-batch on the device
  (``micro_batch / (data * fsdp)`` sequences): per decoder block the inputs of its GEMMs and
  norms, the attention scores and probabilities (fp32, ``heads x seq_len`` per token; with
  fused attention on a GPU or TPU, ``attention_impl: fused``, only the softmax statistics,
  one fp32 per head and token: the kernel keeps no ``seq_len x seq_len`` scores) and the
  MLP's three ``ffn_dim`` products; with remat (``model.overrides.remat: true``) only each
  block's input, plus one block recomputed at a time. The fp32 logits and their gradient
  (two ``vocab`` vectors per token) come on top.

The estimate is a reckoning of what the backward pass keeps alive, not XLA's buffer
assignment: tests/train/test_memory.py checks it against ``compiled.memory_analysis()`` of
the real train step on CPU (argument + output - aliased + temporary bytes) and holds it
within a factor of 1.5 either way; bench/memory_estimate.py measured 0.84-1.21 on CPU and
0.69-1.17 for the 8B model on 8 and 16 H100s, deviceless (docs/RELIABILITY.md, "Memory").
Precision policies' quantized operand copies are short-lived and not counted.

`device_memory()` says how much one device has (CPU: the host's available physical memory,
or what the process's memory cgroup allows when less, shared by its devices; GPU/TPU:
``memory_stats()['bytes_limit']``). `what_fits` lists the settings (remat, micro-batch,
fsdp) under which the estimate fits a budget.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax

from models.llama import LlamaConfig

__all__ = ["OOM_EXIT", "CgroupFiles", "CgroupLimit", "FsdpAnswer", "MemoryEstimate",
           "RunOutOfMemory", "StepShape", "cgroup_limit", "device_memory", "estimate",
           "fit_advice", "for_plan", "fused_attention_on", "gib", "is_out_of_memory",
           "longest_sequence", "out_of_memory_message", "over_budget", "smallest_fsdp",
           "step_shape", "what_fits"]

_F32 = 4


def gib(n: float) -> str:
    """Bytes as GiB (or MiB under one GiB), for messages."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per device of one train step (see the module docstring); ``activations`` is
    for the configured remat, ``activations_remat``/``activations_no_remat`` for both."""

    n_params: int
    params: int
    optimizer: int
    gradients: int
    activations: int
    activations_remat: int
    activations_no_remat: int
    remat: bool
    fused_attention: bool
    sequences_per_device: int
    mesh: tuple[int, int, int]

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients + self.activations

    def as_dict(self) -> dict[str, object]:
        """JSON-able figures (bytes, and the total in GiB)."""
        return {"n_params": self.n_params, "params_bytes": self.params,
                "optimizer_bytes": self.optimizer, "gradients_bytes": self.gradients,
                "activations_bytes": self.activations,
                "activations_bytes_with_remat": self.activations_remat,
                "activations_bytes_without_remat": self.activations_no_remat,
                "remat": self.remat,
                "attention": "fused" if self.fused_attention else "explicit (scores stored)",
                "sequences_per_device": self.sequences_per_device,
                "total_bytes": self.total, "total_gib": round(self.total / 2**30, 3)}

    def describe(self) -> str:
        """One line: the total and its parts."""
        other = "with" if not self.remat else "without"
        alt = self.activations_remat if not self.remat else self.activations_no_remat
        return (f"about {gib(self.total)} per device ({self.n_params / 1e6:,.1f}M params: "
                f"parameters {gib(self.params)}, optimizer state {gib(self.optimizer)}, "
                f"gradients {gib(self.gradients)}, activations {gib(self.activations)} "
                f"for {self.sequences_per_device} sequence(s) per device, "
                f"{'with' if self.remat else 'without'} remat, "
                f"{'fused' if self.fused_attention else 'explicit'} attention; "
                f"{gib(alt)} {other} remat)")


def _split(n: int, ways: int) -> int:
    """The size of one shard of an axis of `n` split `ways` ways (unsplit when it does not
    divide, as `models.sharding` leaves such an axis replicated)."""
    return n // ways if ways > 1 and n % ways == 0 else n


def param_elements(mc: LlamaConfig, *, fsdp: int = 1, tensor: int = 1) -> int:
    """Parameter elements on one device (all of them with fsdp = tensor = 1)."""
    d, V, L = mc.dim, mc.vocab_size, mc.n_layers
    hd = mc.head_dim
    dd = _split(d, fsdp)
    q = _split(mc.n_heads, tensor) * hd
    kv = _split(mc.n_kv_heads, tensor) * hd
    f = _split(mc.ffn_dim, tensor)
    v = _split(V, tensor)
    block = 2 * d + dd * (q + 2 * kv) + q * dd + 3 * dd * f
    embed = v * dd * (1 if mc.tie_embeddings else 2)
    return L * block + embed + d


def fused_attention_on(mc: LlamaConfig, platform: str) -> bool:
    """Whether `mc`'s attention keeps no scores on `platform` ('cpu', 'gpu', 'tpu'):
    ``attention_impl: fused`` runs a flash kernel on GPUs and TPUs and the explicit form on
    CPU (models/attention.py)."""
    return mc.attention_impl == "fused" and platform in ("gpu", "cuda", "tpu")


def _activation_bytes(mc: LlamaConfig, *, tokens: int, seq_len: int, tensor: int,
                      dtype_bytes: int, remat: bool, fused: bool) -> int:
    d, hd, s = mc.dim, mc.head_dim, dtype_bytes
    h = _split(mc.n_heads, tensor)
    kv = _split(mc.n_kv_heads, tensor)
    f = _split(mc.ffn_dim, tensor)
    v = _split(mc.vocab_size, tensor)
    # per token of one block: residual in/out and norm outputs (6 d), q/k/v before and after
    # RoPE, the attention output, fp32 scores + probabilities (a fused kernel: its fp32
    # softmax statistics), the MLP's gate/up/act/product
    scores = h * _F32 if fused else h * seq_len * (_F32 + s)
    block = s * (6 * d + (2 * h + 4 * kv) * hd + h * hd + 4 * f) + scores
    # fp32 logits and their gradient (XLA fuses the log-softmax into both: a deviceless
    # compile of the 8B model on 8 H100s keeps two vocab-wide fp32 rows per token); final norm
    head = 2 * v * _F32 + 2 * d * s
    if remat:
        kept = mc.n_layers * d * s + block  # block inputs, plus one block recomputed
    else:
        kept = mc.n_layers * block
    return tokens * (kept + head)


def estimate(mc: LlamaConfig, *, seq_len: int, micro_batch: int, accum_steps: int,
             mesh: tuple[int, int, int], platform: str = "cpu") -> MemoryEstimate:
    """The `MemoryEstimate` of a train step of `mc` on sequences of `seq_len` tokens,
    `micro_batch` sequences per forward/backward pass (split over data x fsdp),
    `accum_steps` micro-batches per step, on a (data, fsdp, tensor) `mesh` of `platform`
    devices ('cpu', 'gpu', 'tpu': whether fused attention keeps no scores)."""
    data, fsdp, tensor = mesh
    per_dev = max(1, micro_batch // (data * fsdp))
    p = param_elements(mc, fsdp=fsdp, tensor=tensor) * _F32
    dtype_bytes = jax.numpy.dtype(mc.dtype).itemsize

    def act(remat: bool) -> int:
        return _activation_bytes(mc, tokens=per_dev * seq_len, seq_len=seq_len, tensor=tensor,
                                 dtype_bytes=dtype_bytes, remat=remat, fused=fused)

    fused = fused_attention_on(mc, platform)

    a_remat, a_plain = act(True), act(False)
    return MemoryEstimate(
        n_params=param_elements(mc), params=p, optimizer=2 * p,
        gradients=p * (2 if accum_steps > 1 else 1),
        activations=a_remat if mc.remat else a_plain, activations_remat=a_remat,
        activations_no_remat=a_plain, remat=bool(mc.remat), fused_attention=fused,
        sequences_per_device=per_dev,
        mesh=(data, fsdp, tensor))


def _host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CgroupFiles:
    """Where the kernel shows this process's control groups: ``proc_self`` lists them
    (``/proc/self/cgroup``), ``root`` is where their file systems are mounted (tests point
    both at fakes)."""

    proc_self: Path = Path("/proc/self/cgroup")
    root: Path = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CgroupLimit:
    """The tightest memory limit of this process's cgroups: ``available`` bytes (the limit
    less the usage that cannot be reclaimed), the ``limit`` and the ``file`` stating it."""

    available: int
    limit: int
    file: Path


def _read_bytes(path: Path) -> int | None:
    """A cgroup memory file's value; None when absent, unreadable or unlimited ("max" in
    cgroup v2, a value near 2^63 in v1)."""
    try:
        text = path.read_text().strip()
        v = int(text)
    except (OSError, ValueError):
        return None
    return v if v < 2**60 else None


def _inactive_file(path: Path, key: str) -> int:
    """The reclaimable page cache a cgroup's memory.stat counts in its usage."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_limit(files: CgroupFiles = CgroupFiles()) -> CgroupLimit | None:
    """The tightest memory limit over this process's cgroups and their ancestors (cgroup v2
    ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes`` less
    ``memory.usage_in_bytes``; the reclaimable page cache counts as available, as in
    MemAvailable); None without one. A container, or ``systemd-run -p MemoryMax=3G``,
    limits a process below the host's memory, and the kernel kills it (exit 137) at that
    limit, whatever the host has left."""
    try:
        lines = files.proc_self.read_text().splitlines()
    except OSError:
        return None
    best: CgroupLimit | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2, mounted at the root or (hybrid) at unified/
            base = next((b for b in (files.root, files.root / "unified")
                         if (b / "cgroup.controllers").is_file()), None)
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = files.root / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        if base is None or not base.is_dir():
            continue
        d = base / rel.strip().lstrip("/")
        if not d.is_dir():  # a cgroup namespace shows the process's own cgroup as the root
            d = base
        while True:
            limit = _read_bytes(d / names[0])
            if limit is not None:
                used = (_read_bytes(d / names[1]) or 0) - _inactive_file(d / "memory.stat",
                                                                         names[2])
                avail = max(0, limit - max(0, used))
                if best is None or avail < best.available:
                    best = CgroupLimit(available=avail, limit=limit, file=d / names[0])
            if d == base or base not in d.parents:
                break
            d = d.parent
    return best


def device_memory(device: jax.Device | None = None, *,
                  cgroup: CgroupFiles = CgroupFiles()) -> tuple[int | None, str]:
    """(bytes one device can hold, where the figure comes from); (None, why) when unknown.

    CPU: the host's available physical memory (/proc/meminfo MemAvailable), or what the
    process's memory cgroup still allows when that is less (`cgroup_limit`), divided among
    its local CPU devices; GPU/TPU: ``device.memory_stats()['bytes_limit']``.
    """
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        avail = _host_available_bytes()
        limit = cgroup_limit(cgroup)
        n = max(1, len(jax.local_devices(backend="cpu")))
        shared = f", shared by {n} devices" if n > 1 else ""
        if limit is not None and (avail is None or limit.available < avail):
            return limit.available // n, (
                f"CPU: {gib(limit.available)} available under the memory cgroup limit of "
                f"{gib(limit.limit)} ({limit.file}){shared}")
        if avail is None:
            return None, "the host's available memory is unknown"
        return avail // n, f"CPU: {gib(avail)} of physical memory available{shared}"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (a backend without memory_stats)
        stats = {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None, f"{device.platform}: memory_stats() gives no bytes_limit"
    return int(limit), f"{device.device_kind}: bytes_limit {gib(limit)}"


def what_fits(mc: LlamaConfig, *, seq_len: int, global_batch: int, micro_batch: int,
              mesh: tuple[int, int, int], budget: int, platform: str = "cpu") -> list[str]:
    """Settings under which the estimate fits `budget` bytes per device, each as the
    ``--set`` overrides that give it: remat; the largest micro-batch that fits (with the
    current remat, then with remat); all data-parallel devices as fsdp. Empty if none does."""
    data, fsdp, tensor = mesh
    dp = data * fsdp
    out = []

    def fits(m: LlamaConfig, micro: int, msh: tuple[int, int, int]) -> bool:
        return estimate(m, seq_len=seq_len, micro_batch=micro, accum_steps=global_batch // micro,
                        mesh=msh, platform=platform).total <= budget

    remat = dataclasses.replace(mc, remat=True)
    if not mc.remat and fits(remat, micro_batch, mesh):
        out.append("model.overrides.remat=true")
    micros = [m for m in range(micro_batch - 1, 0, -1)
              if global_batch % m == 0 and m % dp == 0]
    for m_cfg, extra in ((mc, ""), (remat, " model.overrides.remat=true")):
        if m_cfg is remat and mc.remat:
            break
        good = next((m for m in micros if fits(m_cfg, m, mesh)), None)
        if good is not None:
            out.append(f"train.micro_batch={good}{extra}")
            break
    if fsdp < dp and fits(mc, micro_batch, (1, dp, tensor)):
        out.append(f"mesh.fsdp={dp} mesh.data=1")
    elif fsdp < dp and not mc.remat and fits(remat, micro_batch, (1, dp, tensor)):
        out.append(f"mesh.fsdp={dp} mesh.data=1 model.overrides.remat=true")
    return out


# --------------------------------------------------------------------------- a run's step
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """What a train step's memory depends on, known from the config alone (no data read):
    the model, ``data.seq_len``, the global and micro-batch, the (data, fsdp, tensor) mesh
    and the devices' platform ('cpu', 'gpu', 'tpu')."""

    model: LlamaConfig
    seq_len: int
    global_batch: int
    micro_batch: int
    mesh: tuple[int, int, int]
    platform: str = "cpu"

    @property
    def accum_steps(self) -> int:
        """Micro-batches per step (``global_batch // micro_batch``, at least 1)."""
        return max(1, self.global_batch // self.micro_batch)

    def estimate(self) -> MemoryEstimate:
        """This step's `MemoryEstimate`."""
        return estimate(self.model, seq_len=self.seq_len, micro_batch=self.micro_batch,
                        accum_steps=self.accum_steps, mesh=self.mesh, platform=self.platform)


def step_shape(config, model: LlamaConfig, mesh: tuple[int, int, int],
               platform: str) -> StepShape:
    """The `StepShape` of a `train.config.Config` with its model config and mesh."""
    t = config.train
    return StepShape(model=model, seq_len=config.data.seq_len, global_batch=t.global_batch,
                     micro_batch=t.micro_batch or t.global_batch, mesh=mesh, platform=platform)


def for_plan(plan, platform: str | None = None) -> MemoryEstimate:
    """The estimate of a validated `train.plan.Plan`'s train step on `platform` (default:
    this process's devices')."""
    return step_shape(plan.config, plan.model_config, plan.mesh_axes,
                      platform or jax.default_backend()).estimate()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsdpAnswer:
    """The smallest ``mesh.fsdp`` (with ``mesh.data=1``) under which a step fits: ``fsdp``
    devices per tensor group, and the ``train.micro_batch`` it needs (the config's, or
    ``fsdp`` when the config's is smaller: one sequence per device)."""

    fsdp: int
    micro_batch: int
    estimate: MemoryEstimate

    def settings(self, shape: StepShape) -> str:
        """The ``--set`` arguments that give it."""
        out = f"--set mesh.fsdp={self.fsdp} --set mesh.data=1"
        if self.micro_batch != shape.micro_batch:
            out += (f" --set train.micro_batch={self.micro_batch} --set train.global_batch="
                    f"{-(-shape.global_batch // self.micro_batch) * self.micro_batch}")
        return out


MAX_FSDP = 4096  # the largest fsdp `smallest_fsdp` considers


def smallest_fsdp(shape: StepShape, budget: int) -> FsdpAnswer | None:
    """The smallest fsdp size (``mesh.data=1``, the shape's tensor size, remat as configured)
    whose estimate fits `budget` bytes per device; None when none up to `MAX_FSDP` does (one
    sequence's activations alone exceed the budget). The sizes tried are the divisors of the
    micro-batch, then the micro-batch times 2, 4, 8, ... with one sequence per device (an
    fsdp that divides neither the batch nor the model's axes would leave them unsplit)."""
    micro, tensor = shape.micro_batch, shape.mesh[2]
    sizes = [(n, micro) for n in range(1, micro + 1) if micro % n == 0]
    n = 2 * micro
    while n <= MAX_FSDP:
        sizes.append((n, n))
        n *= 2
    for n, m in sizes:
        est = dataclasses.replace(shape, micro_batch=m, mesh=(1, n, tensor)).estimate()
        if est.total <= budget:
            return FsdpAnswer(fsdp=n, micro_batch=m, estimate=est)
    return None


def longest_sequence(shape: StepShape, budget: int) -> int | None:
    """The longest ``data.seq_len`` (a multiple of 128) at which one sequence per device fits
    `budget` bytes with the model state spread over up to `MAX_FSDP` devices; None if not
    even 128 tokens do."""
    n = math.gcd(shape.model.dim, MAX_FSDP)  # the widest fsdp that splits the model's axes

    def fits(seq: int) -> bool:
        probe = dataclasses.replace(shape, seq_len=seq, micro_batch=n, global_batch=n,
                                    mesh=(1, n, shape.mesh[2]))
        return probe.estimate().total <= budget

    if not fits(128):
        return None
    lo, hi = 1, max(1, shape.seq_len // 128)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(128 * mid) else (lo, mid - 1)
    return 128 * lo


def fsdp_sentence(shape: StepShape, budget: int) -> str:
    """The smallest fitting fsdp as a sentence (or why none fits)."""
    ans = smallest_fsdp(shape, budget)
    if ans is not None:
        n = ans.fsdp * shape.mesh[2]
        return (f"the smallest mesh.fsdp that fits is {ans.fsdp} ({n} device{'s' * (n != 1)}: "
                f"{ans.settings(shape)}; about {gib(ans.estimate.total)} per device)")
    longest = longest_sequence(shape, budget)
    seq = (f"; the longest data.seq_len that fits is {longest}" if longest else
           "; not even 128 tokens per device fit")
    remat = "" if shape.model.remat else " (or with --set model.overrides.remat=true)"
    return (f"no mesh.fsdp fits{remat}: one sequence of {shape.seq_len} tokens per device "
            f"needs more than {gib(budget)} of activations alone{seq}")


def fit_advice(shape: StepShape, budget: int) -> str:
    """What would fit `budget` bytes per device, as a sentence naming the settings: remat,
    the micro-batch, fsdp over the devices there are, and the smallest fitting fsdp."""
    fits = what_fits(shape.model, seq_len=shape.seq_len, global_batch=shape.global_batch,
                     micro_batch=shape.micro_batch, mesh=shape.mesh, budget=budget,
                     platform=shape.platform)
    fsdp = fsdp_sentence(shape, budget)
    if fits:
        return ("would fit: " + "; or ".join(f"--set {' --set '.join(f.split())}" for f in fits)
                + f"; {fsdp}")
    return f"nothing fits on these devices by remat, micro-batch or fsdp alone; {fsdp}"


def over_budget(shape: StepShape, budget: int | None, source: str) -> str | None:
    """A message when the estimate exceeds `budget` bytes per device (its `source` named),
    else None (also when the budget is unknown)."""
    est = shape.estimate()
    if budget is None or est.total <= budget:
        return None
    return (f"the train step needs {est.describe()}, more than a device has ({source}); "
            + fit_advice(shape, budget))


# --------------------------------------------------------------------------- out of memory
OOM_EXIT = 9  # the exit code of a run that ran out of device memory (docs/RELIABILITY.md)


class RunOutOfMemory(RuntimeError):
    """A run ran out of device memory; the message names the estimate and what would fit."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's out-of-memory (RESOURCE_EXHAUSTED, "Out of memory ...")."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def out_of_memory_message(plan, error: BaseException, saved: str) -> str:
    """The one-line report of an out-of-memory `error` during `plan`'s run; `saved` says
    what the run's checkpoints hold (a sentence)."""
    shape = step_shape(plan.config, plan.model_config, plan.mesh_axes, jax.default_backend())
    est = shape.estimate()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    budget, source = device_memory()
    advice = fit_advice(shape, budget or max(1, est.total // 2))
    return (f"out of device memory ({first[:300]}). Estimate: {est.describe()}; device: "
            f"{source}. {advice[0].upper()}{advice[1:]}. {saved}")
