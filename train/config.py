"""Training configuration: frozen dataclasses, strict YAML parsing, `--set` overrides.

A config file is a YAML mapping with the sections below (every key optional
except where noted; unknown keys, wrong types and bad values are errors that
name the offending key)::

    name: tiny                 # run name; default output directory runs/<name>
    seed: 0                    # model init, data order, randomized-policy keys
    out_dir: null              # default runs/<name>
    jax_cache_dir: null        # persistent compilation cache
    policy: mxfp4_all_h16      # a preset name, a full policy dict, or null (no policy)
    backend: auto              # the quantized GEMMs' route (auto: the chip's fastest exact one)
    model:   {preset, overrides, compute_dtype, init_from}
    data:    {sources, val_sources, format, text_key, split, holdout_every,
              holdout_block, max_docs, tokenizer, vocab_size, eos_token,
              add_bos, seq_len, cache_dir, loader, workers, on_bad_record}
    optim:   {lr, warmup_steps, decay_steps, final_lr_ratio, b1, b2, eps,
              weight_decay, clip_norm}
    train:   {steps, global_batch, micro_batch, eval_every, eval_sequences,
              eval_batch, eval_at_start, target_eval_loss, max_nonfinite,
              log_every, progress, plot, tensorboard}
    checkpoint: {every, keep, async_save, enabled}
    mesh:    {data, fsdp, tensor, distributed}
    mlperf:  {benchmark, org, platform, division, status}
    diagnostics: {enabled, cosine}

`load(path, overrides)` reads a file and applies ``key.sub=value`` overrides
(values parsed as YAML scalars) before validation. `describe()` renders the
schema with defaults and help text for ``--help``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from train.jsonsafe import jsonable


class ConfigError(ValueError):
    """A configuration problem, reported before anything is compiled."""


def _field(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help text (shown by ``describe()``)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    preset: Literal["tiny", "llama3_1b", "llama3_8b"] = _field(
        "tiny", "LlamaConfig preset (models.llama.LlamaConfig.<preset>())")
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={
        "help": "LlamaConfig fields to replace, e.g. {dim: 128, n_layers: 4}. vocab_size "
        "defaults to the tokenizer's vocabulary size for the tiny preset"})
    compute_dtype: Literal["float32", "bfloat16", "float16"] = _field(
        "float32", "activation/compute dtype; master weights are always float32")
    init_from: str | None = _field(
        None, "a Hugging Face Llama checkpoint directory (config.json + safetensors) whose "
        "weights start the run (continued pretraining): its architecture must match the "
        "model's (checked, naming each differing field); its weights become the fp32 master "
        "weights; the optimizer starts fresh. A resumed run continues from its own "
        "checkpoint, not from these weights. See docs/HF.md")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    sources: tuple[str, ...] = _field(
        ("embedded:austen",),
        "training files or globs: .txt/.txt.gz (plain text) or .json/.jsonl(.gz) "
        "(one JSON object per line, C4 style); .parquet under data.loader grain; "
        "'embedded:austen' is the bundled corpus")
    val_sources: tuple[str, ...] = _field(
        (), "validation files/globs (e.g. the C4 validation shard); empty = hold out "
        "part of `sources`")
    format: Literal["auto", "text", "jsonl"] = _field(
        "auto", "file format; auto decides by extension")
    text_key: str = _field("text", "JSON field holding the document text")
    split: Literal["paragraph", "file"] = _field(
        "paragraph", "plain text: one document per blank-line separated paragraph, "
        "or one per file")
    holdout_every: int = _field(
        20, "without val_sources: every N-th block of documents is held out for validation")
    holdout_block: int = _field(50, "documents per hold-out block")
    max_docs: int | None = _field(
        None, "read at most this many documents from sources (and from val_sources)")
    tokenizer: str = _field(
        "bpe", "'bpe' (byte-level BPE trained on the training documents, cached) or a "
        "path to a Hugging Face tokenizer.json")
    vocab_size: int = _field(2048, "vocabulary size of the trained BPE (tokenizer: bpe)")
    eos_token: str | None = _field(
        None, "end-of-document token; default: the tokenizer's known EOS "
        "(<|end_of_text|>, </s>, <|endoftext|>, <eos>)")
    add_bos: bool = _field(False, "also put the tokenizer's BOS before each document")
    seq_len: int = _field(128, "tokens per training sequence")
    cache_dir: str = _field("data_cache", "where prepared token files are cached")
    loader: Literal["prepared", "grain"] = _field(
        "prepared", "'prepared': tokenize the sources once into a cached stream before step 0 "
        "(python -m train.data prepare; small corpora). 'grain': stream the shards (C4 "
        "json.gz, JSONL, parquet), tokenize in worker processes, pack on the fly, resume "
        "exactly from the checkpoint (needs data.val_sources and a tokenizer.json; "
        "docs/DATA.md)")
    workers: int = _field(
        4, "data.loader grain: tokenizer worker processes per host (0: in the training "
        "process); part of the data order, so fixed for a run")
    on_bad_record: Literal["error", "skip"] = _field(
        "error", "data.loader grain: a corrupt gzip stream or bad JSON line stops the run "
        "naming file and line ('error'), or is skipped, reported and counted in the "
        "metrics as data_bad_records ('skip')")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr: float = _field(3e-4, "peak learning rate")
    warmup_steps: int = _field(0, "linear warmup steps")
    decay_steps: int | None = _field(
        None, "cosine horizon in steps (warmup included); default train.steps")
    final_lr_ratio: float = _field(0.1, "cosine decays to final_lr_ratio * lr")
    b1: float = _field(0.9, "AdamW beta1")
    b2: float = _field(0.95, "AdamW beta2")
    eps: float = _field(1e-5, "AdamW epsilon")
    weight_decay: float = _field(0.1, "decoupled weight decay (not on norms / 1-D params)")
    clip_norm: float = _field(1.0, "global gradient-norm clip")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
    steps: int = _field(100, "optimizer steps")
    global_batch: int = _field(16, "sequences per optimizer step")
    micro_batch: int | None = _field(
        None, "sequences per forward/backward pass; global_batch/micro_batch gradient "
        "accumulation steps (default: no accumulation)")
    eval_every: int = _field(0, "evaluate every N steps (0: only at the end)")
    eval_sequences: int = _field(64, "validation sequences per evaluation (a fixed set)")
    eval_batch: int | None = _field(None, "sequences per eval forward pass (default micro batch)")
    eval_at_start: bool = _field(True, "also evaluate before the first step")
    target_eval_loss: float | None = _field(
        None, "stop when eval loss <= this (MLPerf: 3.3)")
    max_nonfinite: int = _field(
        5, "stop after this many consecutive steps with non-finite loss/gradients "
        "(each such step is skipped)")
    log_every: int = _field(1, "write a metrics record every N steps")
    progress: Literal["auto", "bar", "lines", "off"] = _field(
        "auto", "progress display: bar on a terminal, periodic lines otherwise")
    plot: bool = _field(True, "write plot.png (loss vs tokens) at the end")
    tensorboard: bool = _field(
        True, "write TensorBoard event files (scalars) into the run directory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    enabled: bool = _field(True, "write checkpoints and resume from them")
    every: int = _field(0, "save every N steps (0: only at the end)")
    keep: int = _field(3, "keep the last K checkpoints")
    async_save: bool = _field(True, "write checkpoints in the background")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
    data: int = _field(-1, "data-parallel axis size (-1 on one axis: all devices the other "
                       "axes leave)")
    fsdp: int = _field(1, "fully-sharded data-parallel axis size (or -1)")
    tensor: int = _field(1, "tensor-parallel axis size (or -1)")
    distributed: bool = _field(
        False, "call jax.distributed.initialize() first (multi-host). Without the three "
        "settings below JAX detects the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU)")
    coordinator_address: str | None = _field(
        None, "host:port of process 0's coordinator (jax.distributed.initialize)")
    num_processes: int | None = _field(None, "number of processes (hosts)")
    process_id: int | None = _field(None, "this process's index in [0, num_processes)")
    init_timeout_s: int = _field(
        300, "seconds jax.distributed.initialize waits for every process to join the "
        "coordinator before the run stops with exit code 8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPerfSection:
    """The submission records of mllog.txt (MLPerf Training rules; see train/mlperf.py)."""

    benchmark: str | None = _field(
        None, "submission_benchmark; null: llama31_8b for the llama3_8b preset, else the run name")
    org: str = _field("mxjax", "submission_org: who ran it")
    platform: str | None = _field(
        None, "submission_platform; null: '<devices>x<device kind>' of this run")
    division: Literal["closed", "open"] = _field("closed", "submission_division")
    status: Literal["onprem", "cloud", "preview", "research"] = _field(
        "onprem", "submission_status")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnosticsSection:
    """Numerics diagnostics recorded beside the losses (train/diagnostics/numerics.py)."""

    enabled: bool = _field(
        False, "record, at every logged step, the per-GEMM quantization statistics "
        "(mxjax.diagnostics: diag/<gemm>/<field>), per-layer gradient norms and relative "
        "update sizes (grad_collapse_rate, update_ratio_*) into metrics.jsonl and TensorBoard; "
        "losses are unchanged, steps cost more")
    cosine: bool = _field(
        True, "with enabled: also each quantized GEMM's output cosine against the exact "
        "product (one more GEMM per call site)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    name: str = _field("run", "run name")
    seed: int = _field(0, "seed for init, data order and randomized-policy keys")
    out_dir: str | None = _field(None, "output directory (default runs/<name>)")
    policy: str | dict[str, Any] | None = dataclasses.field(default=None, metadata={
        "help": "precision policy: what mxjax.policies.resolve takes: a preset name (see "
        "mxjax.policies.names()), none or null for no policy, a policy dict "
        "(mxjax.policies.to_dict format; from Python also a PrecisionPolicy, stored as its "
        "dict)"})
    backend: str | None = _field(
        "auto", "where the quantized GEMMs of every policy this run compiles run "
        "(mxjax.backends.BACKENDS). auto: the fastest exact route of the chip compiled for "
        "(mxjax.backends.AUTO_CHOICES: MXFP4 on the FP4 units of Blackwell, carried in FP8 "
        "on Hopper; the emulation on CPUs, TPUs and other GPUs), except where the policy "
        "names its backend (name@backend, a dict GEMM's backend); xla: the emulation, bit "
        "for bit the same on every chip; another route: every quantized GEMM on it (refused "
        "where it gives no speed-up on the chip); null: each policy's own (the presets': "
        "xla)")
    jax_cache_dir: str | None = _field(
        None, "persistent JAX compilation cache directory (re-runs, resumes and study runs "
        "skip recompiling; null: off)")
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    mlperf: MLPerfSection = dataclasses.field(default_factory=MLPerfSection)
    diagnostics: DiagnosticsSection = dataclasses.field(default_factory=DiagnosticsSection)

    @property
    def out_path(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name

    @property
    def accum_steps(self) -> int:
        return self.train.global_batch // (self.train.micro_batch or self.train.global_batch)

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps if self.optim.decay_steps is not None else self.train.steps

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/YAML-safe) of the whole config."""
        return jsonable(self)


# --------------------------------------------------------------------------- parsing

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str, what: str = "config") -> Any:
    """Check `value` against the annotation `tp`; return the converted value."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return build(tp, value, path, what=what)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path, what)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # `X | None`: X's own message says more
            raise ConfigError(errors[0])
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got "
                          f"{type(value).__name__} {value!r}")
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans
            alias = {False: "off", True: "on"}[value]
            if alias in typing.get_args(tp):
                return alias
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is tuple:
        (elem,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_convert(v, elem, f"{path}[{i}]", what) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return {str(k): v for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        return _as_int(value, path)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):  # YAML reads .inf/.nan; no setting means them
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def _as_int(value: Any, path: str) -> int:
    """`value` as an int: an int, or a number written in float notation whose value is a whole
    number (``1e3``, ``1000.0``: YAML 1.1 reads ``1e3`` as a string); anything else is a
    ConfigError naming `path`."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected an integer, got bool {value!r}")
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{path}: expected an integer, got str {value!r}") from None
    if not isinstance(number, float):
        raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
    if not (math.isfinite(number) and number == int(number)):
        raise ConfigError(f"{path}: expected an integer, got {value!r}, which is not a whole "
                          "number")
    return int(number)


def build(cls: type, raw: Mapping[str, Any], path: str = "", *, what: str = "config") -> Any:
    """An instance of the config dataclass `cls` from the mapping `raw`.

    Every value is checked against its field's annotation (nested dataclasses,
    unions, Literal, tuple, dict, bool/int/float/str); unknown keys and wrong
    types raise ConfigError naming the key (``path.key``; `what` names the kind
    of config in the unknown-key message). Value ranges are the caller's checks.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, raw)) - names)
    if unknown:
        where = f" in section '{path}'" if path else ""
        raise ConfigError(f"unknown {what} key(s){where}: {', '.join(unknown)}; valid keys: "
                          f"{', '.join(sorted(names))}")
    kwargs = {}
    for k, v in raw.items():
        kwargs[k] = _convert(v, hints[k], f"{path}.{k}" if path else k, what)
    return cls(**kwargs)


def from_dict(raw: Mapping[str, Any]) -> Config:
    """Build and validate a `Config` from a nested mapping (as read from YAML)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(raw).__name__}")
    spec = raw.get("policy")
    if spec is not None and not isinstance(spec, (str, Mapping)):
        from mxjax import policies  # only for a policy object (the config module stays light)

        if isinstance(spec, policies.PrecisionPolicy):  # stored as its dict (YAML/JSON-safe)
            raw = {**raw, "policy": jsonable(policies.to_dict(spec))}
    data = raw.get("data")
    if isinstance(data, Mapping) and data.get("format") == "parquet":  # not a format option
        raise ConfigError("data.format: parquet files are read by the grain loader, which "
                          "tells them by their .parquet name (data.format auto): --set "
                          "data.loader=grain, with the 'parquet' extra (docs/DATA.md)")
    cfg = expand_user(build(Config, raw))
    check(cfg)
    return cfg


def expand_user(cfg: Config) -> Config:
    """`cfg` with ``~`` expanded in every path setting (out_dir, jax_cache_dir,
    data.cache_dir, data.tokenizer, data.sources, data.val_sources, model.init_from).

    Expanded once here, so every consumer (and config.yaml) sees the real path
    rather than a directory literally named ``~`` in the working directory.
    """
    def ex(p: str | None) -> str | None:
        return os.path.expanduser(p) if p else p

    d = cfg.data
    data = dataclasses.replace(
        d, cache_dir=ex(d.cache_dir),
        tokenizer=d.tokenizer if d.tokenizer == "bpe" else ex(d.tokenizer),
        sources=tuple(s if s.startswith("embedded:") else ex(s) for s in d.sources),
        val_sources=tuple(s if s.startswith("embedded:") else ex(s) for s in d.val_sources))
    return dataclasses.replace(cfg, out_dir=ex(cfg.out_dir), jax_cache_dir=ex(cfg.jax_cache_dir),
                               data=data, model=dataclasses.replace(
                                   cfg.model, init_from=ex(cfg.model.init_from)))


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value`` into (["a","b","c"], yaml-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set: bad key {key!r} in {item!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {text!r}: {e}") from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each ``key.sub=value`` override applied."""
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: '{p}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return raw


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (or the defaults if `path` is None), apply overrides, validate."""
    raw = read_yaml(path) if path is not None else {}
    return from_dict(apply_overrides(raw, overrides))


def require(cond: bool, msg: str) -> None:
    """Raises ConfigError(msg) unless `cond` (the value rules of every config in train/)."""
    if not cond:
        raise ConfigError(msg)


def require_unique(values: Sequence[Any], key: str, *, allow_empty: bool = False) -> None:
    """Raises ConfigError naming `key` when `values` repeats an entry (or is empty)."""
    require(allow_empty or len(values) > 0,
            f"{key}: expected a non-empty list, got {list(values)!r}")
    require(len(set(values)) == len(values), f"{key}: repeated entries in {list(values)!r}")


def check(cfg: Config) -> None:
    """Value checks that need no model, data or devices (all raise ConfigError)."""
    t, o, d, c, m = cfg.train, cfg.optim, cfg.data, cfg.checkpoint, cfg.mesh
    need = require

    need(bool(cfg.name) and "/" not in cfg.name,
         f"name: must be a non-empty name without '/', got {cfg.name!r}")
    need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    need(t.global_batch >= 1, f"train.global_batch must be >= 1, got {t.global_batch}")
    if t.micro_batch is not None:
        need(t.micro_batch >= 1 and t.global_batch % t.micro_batch == 0,
             f"train.micro_batch ({t.micro_batch}) must divide train.global_batch "
             f"({t.global_batch})")
    need(t.eval_every >= 0, f"train.eval_every must be >= 0, got {t.eval_every}")
    need(t.eval_sequences >= 1, f"train.eval_sequences must be >= 1, got {t.eval_sequences}")
    if t.eval_batch is not None:
        need(t.eval_batch >= 1, f"train.eval_batch must be >= 1, got {t.eval_batch}")
    need(t.max_nonfinite >= 1, f"train.max_nonfinite must be >= 1, got {t.max_nonfinite}")
    need(t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}")
    need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    need(cfg.decay_steps >= 1, f"optim.decay_steps must be >= 1, got {cfg.decay_steps}")
    need(0.0 <= o.final_lr_ratio <= 1.0,
         f"optim.final_lr_ratio must be in [0, 1], got {o.final_lr_ratio}")
    need(0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0, "optim.b1 and optim.b2 must be in [0, 1)")
    need(o.eps > 0, f"optim.eps must be > 0, got {o.eps}")
    need(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    need(o.clip_norm > 0, f"optim.clip_norm must be > 0, got {o.clip_norm}")
    need(d.seq_len >= 2, f"data.seq_len must be >= 2, got {d.seq_len}")
    need(d.vocab_size >= 260,
         f"data.vocab_size must be >= 260 (256 bytes + specials), got {d.vocab_size}")
    need(d.holdout_every >= 2, f"data.holdout_every must be >= 2, got {d.holdout_every}")
    need(d.holdout_block >= 1, f"data.holdout_block must be >= 1, got {d.holdout_block}")
    need(len(d.sources) >= 1, "data.sources must name at least one file")
    need(d.workers >= 0, f"data.workers must be >= 0, got {d.workers}")
    if d.loader == "prepared":
        need(d.on_bad_record == "error", "data.on_bad_record: 'skip' is data.loader grain's; "
             "the prepared loader checks every record and stops at a bad one")
    else:
        need(d.max_docs is None, "data.max_docs: not used by data.loader grain (it streams "
             "the shards); remove it or list fewer files")
    if d.max_docs is not None:
        need(d.max_docs >= 1, f"data.max_docs must be >= 1, got {d.max_docs}")
    need(c.every >= 0, f"checkpoint.every must be >= 0, got {c.every}")
    need(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    for ax in ("data", "fsdp", "tensor"):
        v = getattr(m, ax)
        need(v >= 1 or v == -1, f"mesh.{ax} must be >= 1 or -1, got {v}")
    need([m.data, m.fsdp, m.tensor].count(-1) <= 1, "mesh: at most one axis may be -1")
    if m.num_processes is not None:
        need(m.num_processes >= 1, f"mesh.num_processes must be >= 1, got {m.num_processes}")
    need(m.init_timeout_s >= 1, f"mesh.init_timeout_s must be >= 1, got {m.init_timeout_s}")
    if m.process_id is not None:
        need(0 <= m.process_id < (m.num_processes or m.process_id + 1),
             f"mesh.process_id must be in [0, mesh.num_processes), got {m.process_id}")
    if isinstance(cfg.policy, str):
        need(bool(cfg.policy), "policy: empty name (use null for no policy)")
    if cfg.backend is not None:
        from mxjax.backends import BACKENDS  # a constant; the config module stays light

        need(cfg.backend in BACKENDS,
             f"backend: expected one of {', '.join(BACKENDS)} or null, got {cfg.backend!r}")
    if cfg.model.init_from is not None:
        need(bool(cfg.model.init_from), "model.init_from: empty path (use null to start from "
             "random weights)")


def policy_argument(text: str) -> str | dict[str, Any]:
    """``--policy``'s value as the config's ``policy`` takes it: a JSON/YAML mapping (text
    starting with '{') becomes a dict; anything else is a name for `mxjax.policies.resolve`.
    ConfigError for a mapping that does not parse."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"--policy: {text[:60]!r} is not a JSON/YAML mapping "
                          f"({' '.join(str(e).split())}); quote it whole in the shell, e.g. "
                          "--policy '{fprop: mxfp4, dgrad: null}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--policy: expected a preset name or a JSON/YAML mapping, got "
                          f"{text[:60]!r}")
    return value


def describe(width: int = 100) -> str:
    """Human-readable schema with defaults and help, for ``--help``."""
    lines = []

    def entry(indent: str, name: str, tp: Any, default: Any, help_text: str) -> None:
        head = f"{indent}{name} ({_type_name(tp)}, default {default!r}): {help_text}"
        lines.extend(textwrap.wrap(head, width, subsequent_indent=indent + "    "))

    for f in dataclasses.fields(Config):
        tp = typing.get_type_hints(Config)[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{f.name}:")
            hints = typing.get_type_hints(tp)
            for g in dataclasses.fields(tp):
                default = g.default if g.default is not dataclasses.MISSING else g.default_factory()
                entry("  ", g.name, hints[g.name], default, g.metadata.get("help", ""))
        else:
            entry("", f.name, tp, f.default, f.metadata.get("help", ""))
    return "\n".join(lines)
