"""MLPerf Training logs through MLCommons' ``mlperf_logging.mllog``, and their compliance check.

`MLPerfLog` writes a run's ``mllog.txt`` with the records and the order the
MLPerf Training rules ask for (ruleset `RULESET`, checked against the
``llama31_8b`` benchmark's ``closed_llama31_8b.yaml``)::

    cache_clear                          value false: the loop does not drop OS caches
    init_start
    submission_* , hyper-parameters      `run_header`: one record each
    init_stop, run_start                 after the model state exists
    epoch_start                          one epoch spans the run (as the reference does)
    block_start                          before the first training step after each eval
    block_stop, eval_start, eval_accuracy, eval_stop    at every evaluation
    block_stop, epoch_stop, run_stop     status 'success' (target reached) or 'aborted'

``eval_accuracy`` is the validation log-perplexity (mean token cross-entropy in
nats; lower is better) with ``samples_count`` and ``epoch_num`` both the
sequences trained so far (the reference logs epoch numbers in sequences).
Every record also carries ``metadata.step`` so that a resumed run can drop the
records of the steps it redoes.

`check_compliance` runs the package's compliance checker on such a file;
`check_run_log` picks the rules for a run's log: the full rules of its benchmark
when the ruleset has them (``llama31_8b``), else, for a run that is no MLPerf
benchmark (``configs/tiny.yaml``'s logs ``submission_benchmark: tiny``, for which
the checker has no rules file and stops with ``FileNotFoundError``), the log's
structure under ``llama31_8b``'s rules, with that benchmark's hyper-parameter
rules reported apart (``python -m train mlperf-check RUN_DIR``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from mlperf_logging.compliance_checker import mlp_compliance
from mlperf_logging.mllog import constants as K
from mlperf_logging.mllog.mllog import MLLogger

RULESET = "6.1.0"
"""The newest MLPerf Training ruleset in mlperf-logging 4.1.68 with a ``llama31_8b`` benchmark."""
BENCHMARK = K.LLAMA31_8B
PREFIX = ":::MLLOG "

# MLPerf's precision names, lowest precision first (4-bit MX scales are coarser than NVFP4's).
_PRECISION_ORDER = ("mxfp4", "nvfp4", "mxfp6", "fp8", "bfloat16", "fp16", "tf32", "fp32")
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bfloat16", "float16": "fp16"}
# mxjax format names (mxjax.formats) -> MLPerf precision names.
_FORMAT_NAMES = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "mxfp8_e4m3": "fp8", "mxfp8_e5m2": "fp8",
                 "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
_PASSTHROUGH = "bf16"  # the pass-through format: the operand keeps the compute dtype


def dtype_precision(dtype: Any) -> str:
    """MLPerf's name for a compute dtype ('float32' -> 'fp32', 'bfloat16', 'float16' -> 'fp16')."""
    name = str(getattr(dtype, "name", dtype))
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype: no MLPerf precision name for {name!r}; expected one of "
                         f"{', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def lowest(names: Sequence[str]) -> str:
    """The lowest of MLPerf precision names (e.g. ['fp8', 'mxfp4'] -> 'mxfp4')."""
    bad = [n for n in names if n not in _PRECISION_ORDER]
    if bad or not names:
        raise ValueError(f"names: expected MLPerf precision names from {_PRECISION_ORDER}, "
                         f"got {list(names)!r}")
    return min(names, key=_PRECISION_ORDER.index)


def policy_precision(policy_record: Mapping[str, Any] | None, compute_dtype: Any) -> str:
    """Lowest precision of any GEMM operand under a policy.

    ``policy_record`` is the policy as ``mxjax.policies.to_dict`` writes it
    ({'fprop': {'lhs': {'fmt': 'mxfp4', ...}, 'rhs': ...}, 'dgrad': ..., 'wgrad': ...})
    or None (no policy: every GEMM runs in the compute dtype). Pass-through
    operands ('bf16') run in ``compute_dtype``.
    """
    base = dtype_precision(compute_dtype)
    if policy_record is None:
        return base
    names = [base]
    for gemm in ("fprop", "dgrad", "wgrad"):
        for side in ("lhs", "rhs"):
            try:
                fmt = policy_record[gemm][side]["fmt"]
            except (KeyError, TypeError):
                raise ValueError(f"policy_record: no {gemm}.{side}.fmt in {policy_record!r}") \
                    from None
            if fmt == _PASSTHROUGH:
                continue
            if fmt not in _FORMAT_NAMES:
                raise ValueError(f"policy_record: format {fmt!r} of {gemm}.{side} has no MLPerf "
                                 f"precision name (known: {', '.join(_FORMAT_NAMES)})")
            names.append(_FORMAT_NAMES[fmt])
    return lowest(names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the MLPerf header reports about a run that the config alone does not give.

    policy_name: the precision policy's display name. policy_record: the policy as
    a dict (``mxjax.policies.to_dict``) or None. compute_dtype: the model's
    activation dtype. quantized_attention: whether the attention GEMMs run under
    the policy. tensor_parallelism: the mesh's tensor axis. micro_batch_per_replica:
    sequences per forward pass on one data-parallel replica. train_samples:
    sequences in the training split (None for a streamed corpus: not counted).
    platform: e.g. '8xNVIDIA H200'.
    config_filename: where the run's resolved config was written.
    """

    policy_name: str
    policy_record: Mapping[str, Any] | None
    compute_dtype: str
    quantized_attention: bool
    tensor_parallelism: int
    micro_batch_per_replica: int
    train_samples: int | None
    platform: str
    config_filename: str


def run_header(config: Any, facts: RunFacts) -> list[tuple[str, Any]]:
    """The submission and hyper-parameter records of a run, in logging order.

    ``config`` is a `train.config.Config`. The learning-rate schedule is linear
    warmup over ``warmup_steps`` then cosine over the following
    ``decay_steps - warmup_steps`` steps, so that span is what
    ``opt_learning_rate_decay_steps`` reports (the rules ask for 1,200,000 minus
    the warmup); ``max_steps`` is ``train.steps``.
    """
    c, t, o, m = config, config.train, config.optim, config.mlperf
    linear = policy_precision(facts.policy_record, facts.compute_dtype)
    base = dtype_precision(facts.compute_dtype)
    benchmark = m.benchmark or (BENCHMARK if c.model.preset == "llama3_8b" else c.name)
    return [
        (K.SUBMISSION_BENCHMARK, benchmark),
        (K.SUBMISSION_ORG, m.org),
        (K.SUBMISSION_DIVISION, m.division),
        (K.SUBMISSION_STATUS, m.status),
        (K.SUBMISSION_PLATFORM, facts.platform),
        (K.CONFIG_FILENAME, facts.config_filename),
        (K.SEED, c.seed),
        (K.GLOBAL_BATCH_SIZE, t.global_batch),
        (K.MICRO_BATCH_SIZE, facts.micro_batch_per_replica),
        (K.GRADIENT_ACCUMULATION_STEPS, c.accum_steps),
        (K.MAX_SEQUENCE_LENGTH, c.data.seq_len),
        (K.TRAIN_SAMPLES, facts.train_samples),
        (K.EVAL_SAMPLES, t.eval_sequences),
        (K.MAX_STEPS, t.steps),
        (K.OPT_NAME, K.ADAMW),
        (K.OPT_BASE_LR, o.lr),
        (K.OPT_END_LR, o.lr * o.final_lr_ratio),
        (K.OPT_LR_WARMUP_STEPS, o.warmup_steps),
        (K.OPT_LR_DECAY_STEPS, c.decay_steps - o.warmup_steps),
        (K.OPT_LR_DECAY_SCHEDULE, "cosine with linear warmup"),
        (K.OPT_ADAMW_BETA_1, o.b1),
        (K.OPT_ADAMW_BETA_2, o.b2),
        (K.OPT_ADAMW_EPSILON, o.eps),
        (K.OPT_ADAMW_WEIGHT_DECAY, o.weight_decay),
        (K.OPT_GRADIENT_CLIP_NORM, o.clip_norm),
        ("target_accuracy", t.target_eval_loss),
        (K.TENSOR_PARALLELISM, facts.tensor_parallelism),
        (K.PIPELINE_PARALLELISM, 1),
        (K.CONTEXT_PARALLELISM, 1),
        (K.EXPERT_PARALLELISM, 1),
        (K.LOWEST_NUMERICAL_PRECISION_IN_LINEAR, linear),
        (K.LOWEST_NUMERICAL_PRECISION_IN_ATTN,
         lowest([base, linear]) if facts.quantized_attention else base),
        # Activations and gradients cross devices in the compute dtype (or fp32); quantized
        # GEMM operands are formed inside each GEMM.
        (K.LOWEST_NUMERICAL_PRECISION_IN_COMM, base),
        ("precision_policy", facts.policy_name),
    ]


def plan_facts(plan: Any, *, train_samples: int | None, config_filename: str) -> RunFacts:
    """`RunFacts` of a validated `train.plan.Plan` on this process's devices.

    The platform is ``mlperf.platform`` or ``'<device count>x<device kind>'``.
    """
    c, mc = plan.config, plan.model_config
    data, fsdp, tensor = plan.mesh_axes
    return RunFacts(
        policy_name=plan.policy_name, policy_record=plan.policy_record,
        compute_dtype=np.dtype(mc.dtype).name,
        quantized_attention=bool(plan.policy is not None and mc.quantize_attention
                                 and mc.attention_impl == "explicit"),
        tensor_parallelism=tensor,
        micro_batch_per_replica=(c.train.micro_batch or c.train.global_batch) // (data * fsdp),
        train_samples=train_samples,
        platform=c.mlperf.platform or f"{jax.device_count()}x{jax.devices()[0].device_kind}",
        config_filename=config_filename)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The parsed ``:::MLLOG`` records of a file (other lines and a torn last line skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        if line.startswith(PREFIX):
            try:
                out.append(json.loads(line[len(PREFIX):]))
            except json.JSONDecodeError:
                continue
    return out


class MLPerfLog:
    """A run's MLPerf log (``mllog.txt``), written through ``mlperf_logging.mllog``.

    Args:
      path: the log file.
      resume_step: None starts a fresh file; an int keeps the records with
        ``metadata.step <= resume_step`` and appends after them (the header is
        not repeated: call `begin_init`/`begin_run` on fresh runs only).
    """

    def __init__(self, path: str | Path, *, resume_step: int | None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._in_block = False
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = []
            if self.path.is_file():
                for line in self.path.read_text().splitlines():
                    if not line.startswith(PREFIX):
                        continue
                    try:
                        rec = json.loads(line[len(PREFIX):])
                    except json.JSONDecodeError:
                        continue
                    if rec.get("metadata", {}).get("step", 0) <= resume_step:
                        kept.append(line + "\n")
                        if rec["key"] in (K.BLOCK_START, K.BLOCK_STOP):
                            self._in_block = rec["key"] == K.BLOCK_START
            self.path.write_text("".join(kept))
        # A private logger (not registered with `logging`), so runs never share handlers.
        self._handler = logging.FileHandler(self.path, mode="a", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.Logger(f"mxjax.mllog:{self.path}", level=logging.INFO)  # noqa: LOG001
        logger.addHandler(self._handler)
        # metadata.file is the caller's path relative to the repository (e.g. train/trainer.py)
        self._mllog = MLLogger(logger=logger, root_dir=str(Path(__file__).resolve().parents[2]))

    def _log(self, kind: str, key: str, value: Any = None, *, step: int, depth: int = 0,
             **metadata: Any) -> None:
        """``depth``: frames between this and the public method (for the caller's file/line)."""
        fn = {"event": self._mllog.event, "start": self._mllog.start, "end": self._mllog.end}[kind]
        fn(key=key, value=value, metadata={"step": int(step), **metadata},
           stack_offset=3 + depth)

    def event(self, key: str, value: Any = None, *, step: int, **metadata: Any) -> None:
        """A POINT_IN_TIME record (e.g. an extra key); metadata keys become metadata fields."""
        self._log("event", key, value, step=step, **metadata)

    def begin_init(self, header: Sequence[tuple[str, Any]]) -> None:
        """``cache_clear``, ``init_start``, then the header records (`run_header`)."""
        self._log("event", K.CACHE_CLEAR, False, step=0)
        self._log("start", K.INIT_START, step=0)
        for key, value in header:
            self._log("event", key, value, step=0)

    def begin_run(self) -> None:
        """``init_stop``, ``run_start`` and the run's ``epoch_start`` (samples 0)."""
        self._log("end", K.INIT_STOP, step=0)
        self._log("start", K.RUN_START, step=0)
        self._log("start", K.EPOCH_START, step=0, epoch_num=0, samples_count=0)

    def train_block(self, *, step: int, samples: int) -> None:
        """Opens a block (``block_start``) unless one is open; call before each training step."""
        if not self._in_block:
            self._log("start", K.BLOCK_START, step=step, samples_count=samples,
                      epoch_num=samples)
            self._in_block = True

    def _close_block(self, step: int, samples: int) -> None:
        if self._in_block:
            self._log("end", K.BLOCK_STOP, step=step, depth=1, samples_count=samples,
                      epoch_num=samples)
            self._in_block = False

    def evaluation(self, eval_loss: float, *, step: int, samples: int) -> None:
        """Closes the open block; ``eval_start``, ``eval_accuracy`` (log-perplexity),
        ``eval_stop``."""
        self._close_block(step, samples)
        md = {"samples_count": samples, "epoch_num": samples}
        self._log("start", K.EVAL_START, step=step, **md)
        self._log("event", K.EVAL_ACCURACY, float(eval_loss), step=step, **md)
        self._log("end", K.EVAL_STOP, step=step, **md)

    def end_run(self, *, success: bool, step: int, samples: int) -> None:
        """Closes the block and the epoch; ``run_stop`` with status 'success' or 'aborted'."""
        self._close_block(step, samples)
        self._log("end", K.EPOCH_STOP, step=step, epoch_num=samples, samples_count=samples)
        self._log("end", K.RUN_STOP, step=step, status=K.SUCCESS if success else K.ABORTED,
                  samples_count=samples)

    def close(self) -> None:
        self._handler.close()


# --------------------------------------------------------------------------- compliance

@dataclasses.dataclass(frozen=True, kw_only=True)
class ComplianceResult:
    """Outcome of the MLPerf compliance checker on one log.

    passed: no failure. failures: {log key: the checker's message}; an
    at-least-one check (e.g. the target accuracy) is filed under its key, other
    messages not tied to a key under ``'*<i>'``. warnings: {key: message}.
    """

    passed: bool
    failures: dict[str, str]
    warnings: dict[str, str]


def check_compliance(path: str | Path, *, ruleset: str = RULESET) -> ComplianceResult:
    """Run ``mlperf_logging.compliance_checker`` (training, `ruleset`) on a log file.

    Uses the checker's own classes (``mlp_compliance.make_checker`` /
    ``check_file``, what ``python -m mlperf_logging.compliance_checker`` runs)
    and returns its messages grouped by the failing key.
    """
    checker = mlp_compliance.make_checker("training", ruleset, False, False)
    try:
        checker.check_file(str(path), f"training_{ruleset}/common.yaml")
    except FileNotFoundError as e:  # e.g. a benchmark without rules: the checker names it, then
        checker.put_message(f"the checker stopped: {e}")  # fails to open that file
    finally:
        mlp_compliance.enqueued_configs.clear()  # the checker's module-level queue
    failures = dict(checker.overwritable)
    for i, msg in enumerate(checker.not_overwritable):
        # at-least-one checks read "Failed checks for <key> : <test>"
        m = re.match(r"Failed checks for (\w+) :", msg)
        failures[m.group(1) if m and m.group(1) not in failures else f"*{i}"] = msg
    return ComplianceResult(passed=not failures, failures=failures,
                            warnings=dict(checker.warnings))


def ruleset_dir(ruleset: str = RULESET) -> Path:
    """The checker's rules directory of a training ruleset (``training_<ruleset>``)."""
    return Path(mlp_compliance.__file__).parent / f"training_{ruleset}"


def benchmark_rule_keys(benchmark: str, *, division: str = "closed",
                        ruleset: str = RULESET) -> frozenset[str]:
    """The log keys the rules file of one benchmark (``<division>_<benchmark>.yaml``) checks."""
    p = ruleset_dir(ruleset) / f"{division}_{benchmark}.yaml"
    rules = yaml.safe_load(p.read_text()) or []
    return frozenset(r["KEY"]["NAME"] for r in rules if isinstance(r, dict) and "KEY" in r)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogCheck:
    """`check_run_log`'s verdict on one log.

    benchmark/division: what the log's submission records say. checked_as: the
    benchmark whose rules applied (``benchmark`` itself when the ruleset has its
    rules, else `BENCHMARK`). result: the checker's result on the log (as
    ``checked_as``). benchmark_differences: for a log that is no MLPerf
    benchmark, the failures of ``checked_as``'s own hyper-parameter rules (a
    CPU config differs from the benchmark by design); empty otherwise.
    passed: no other failure (the structure, order and required records, and
    for a real benchmark every rule).
    """

    path: Path
    ruleset: str
    benchmark: str | None
    division: str | None
    checked_as: str
    result: ComplianceResult
    benchmark_differences: dict[str, str]
    passed: bool

    @property
    def is_benchmark(self) -> bool:
        return self.benchmark == self.checked_as


def check_run_log(path: str | Path, *, ruleset: str = RULESET) -> LogCheck:
    """Check a run's ``mllog.txt`` with the rules that apply to it (see the module doc).

    A log naming a benchmark the ruleset has rules for is checked as it is. Any
    other (e.g. ``tiny``, whose rules file the checker would fail to open) is
    checked as `BENCHMARK` in a temporary copy whose ``submission_benchmark``
    says so; failures of that benchmark's own rules (``closed_llama31_8b.yaml``:
    sequence length, optimizer, eval size, target, steps) are reported in
    ``benchmark_differences`` and do not fail the check; everything else
    (record order, required records, precision disclosure) must pass.
    Raises FileNotFoundError when ``path`` does not exist, ValueError for an
    unknown ruleset.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no MLPerf log at {p}")
    if not ruleset_dir(ruleset).is_dir():
        raise ValueError(f"ruleset {ruleset!r}: mlperf_logging has no training_{ruleset} rules")
    values = {r.get("key"): r.get("value") for r in read_records(p)}
    bench, division = values.get(K.SUBMISSION_BENCHMARK), values.get(K.SUBMISSION_DIVISION)
    div = division if division in ("closed", "open") else "closed"
    known = isinstance(bench, str) and (ruleset_dir(ruleset) / f"{div}_{bench}.yaml").is_file()
    if known:
        res = check_compliance(p, ruleset=ruleset)
        return LogCheck(path=p, ruleset=ruleset, benchmark=bench, division=division,
                        checked_as=bench, result=res, benchmark_differences={},
                        passed=res.passed)
    lines = []
    for line in p.read_text().splitlines(keepends=True):
        if line.startswith(PREFIX):
            try:
                rec = json.loads(line[len(PREFIX):])
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict) and rec.get("key") == K.SUBMISSION_BENCHMARK:
                rec["value"] = BENCHMARK
                line = PREFIX + json.dumps(rec) + "\n"
        lines.append(line)
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, p.name)
        Path(copy).write_text("".join(lines))
        res = check_compliance(copy, ruleset=ruleset)
    own = benchmark_rule_keys(BENCHMARK, division=div, ruleset=ruleset)
    differences = {k: v for k, v in res.failures.items() if k in own}
    rest = {k: v for k, v in res.failures.items() if k not in own}
    return LogCheck(path=p, ruleset=ruleset, benchmark=bench, division=division,
                    checked_as=BENCHMARK, result=res, benchmark_differences=differences,
                    passed=not rest)
