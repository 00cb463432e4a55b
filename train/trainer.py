"""The trainer: the host loop around a run's compiled pieces (`train.run.CompiledRun`).

`Trainer(plan, hooks).run()` resumes from the run directory's last checkpoint
(after checking it belongs to this setup), evaluates every ``train.eval_every``
steps, stops at the target eval loss or after ``train.max_nonfinite``
non-finite steps in a row (status ``'nonfinite'``; the checkpoints written
before are untouched), checkpoints every ``checkpoint.every`` steps and at the
end, and writes metrics.jsonl, mllog.txt (`train.output.mlperf`), TensorBoard event
files (`train.output.tensorboard_log`, unless ``train.tensorboard`` is false), plot.png
and summary.json.

Between two steps every process agrees (`train.preemption.agree`) whether to
stop: on SIGTERM/SIGINT (status ``'preempted'``) or a damaged batch (status
``'data_error'``) the state of the last step is checkpointed first, and the same
command resumes; a checkpoint that could not be written raises
`train.checkpoint.CheckpointWriteError`. With ``checkpoint.enabled: false`` a
directory holding another run's outputs is refused (`train.output.previous`).

Everything runs under a (data, fsdp, tensor) mesh with the model's partition
rules (`models.sharding`); each process feeds its slice of every global batch.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import yaml

from models import sharding as shd
from train import backend as gemm_backend
from train import data as datamod
from train import execution, memory
from train.checkpoint import Checkpointer, CheckpointWriteError
from train.compat import fingerprint, latest_resumable, refuse_checkpoints_when_disabled
from train.config import ConfigError
from train.diagnostics import numerics
from train.hooks import Hooks
from train.output import mlperf
from train.output.metrics import MetricsWriter, Progress, Tee
from train.output.previous import check_reuse, relocated
from train.output.summary import (
    RunSummary,
    earlier_segments,
    read_summary,
    segment_record,
    summarize,
)
from train.output.tensorboard_log import TensorBoardWriter
from train.plan import Plan
from train.preemption import (
    STOP_DATA_ERROR,
    STOP_SIGNAL,
    STOP_WRITE_FAILED,
    StopRequested,
    StopSignals,
    agree,
)
from train.process import fetch
from train.run import CompiledRun
from train.run_lock import RunDirNotWritable
from train.step import policy_base_key

# Stops after which the same command resumes the run (the MLPerf log stays open).
RESUMABLE_STOPS = ("preempted", "data_error")


class _Null:
    """Stands in for the metrics writers on non-primary hosts."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


class Trainer:
    """The host loop of a run (built from a validated `Plan`); `run()` trains.

    ``compiled`` is the run's `train.run.CompiledRun` (mesh, optimizer, state layout, jitted
    steps, data); ``mesh``, ``tx``, ``layout``, ``abs_state``, ``loader``, ``eval_data`` are
    its pieces.

    Useful on its own for benchmarks and tests: ``init_state()`` (the sharded
    fresh state), ``train_step(state, batch) -> (state, metrics)`` (jitted, state
    donated), ``batch(step)`` (the global batch of a step, placed on the mesh),
    ``evaluate(params) -> float`` (mean validation cross-entropy).
    """

    def __init__(self, plan: Plan, hooks: Hooks | None = None, verbose: bool = True, *,
                 read_only: bool = False):
        if plan.config.diagnostics.enabled:
            if hooks is not None:
                raise ConfigError("diagnostics.enabled: the run builds its own hooks "
                                  "(train.diagnostics.numerics.for_run); pass either hooks or "
                                  "diagnostics.enabled, not both")
            hooks = numerics.for_run(plan.model_config, cosine=plan.config.diagnostics.cosine)
        self.plan, self.cfg, self.hooks, self.verbose = plan, plan.config, hooks or Hooks(), verbose
        self.read_only = read_only  # the run dir cannot be written: only a finished run may "run"
        c = self.cfg
        self.out = c.out_path
        self.out.mkdir(parents=True, exist_ok=True)
        self.compiled = run = CompiledRun(plan, hooks=self.hooks)
        self._routes: dict[str, Any] | None = None  # what each GEMM runs on (logged at start)
        self.mesh, self.tx, self.schedule, self.layout = run.mesh, run.tx, run.schedule, run.layout
        self.abs_state = run.abstract
        self.n_params = run.n_params
        self._train_step = run.train_step(plan.policy)
        self.primary = jax.process_index() == 0
        self.train_seqs = run.train_sequences
        self.loader = run.loader(c.seed)
        self.eval_data = run.eval_batches
        self.tokens_per_step = run.tokens_per_step
        self.policy_base = policy_base_key(c.seed)
        self._metrics: MetricsWriter | None = None  # the primary's, once training starts
        # What a checkpoint must match, computed once: a save never reads the data files
        # again (a shard, tokenizer or validation file gone by then cannot fail it), and
        # every checkpoint of this process records the data as it was when it started.
        self.compat = fingerprint(plan)

    def init_state(self):
        return self.compiled.init_state(self.cfg.seed)

    def train_step(self, state, batch):
        with shd.use_mesh(self.mesh):
            return self._train_step(state, batch, self.policy_base)

    def batch(self, step: int) -> jax.Array:
        return self.compiled.put(self.loader.batch(step))

    def _log(self, msg: str) -> None:
        if self.verbose and jax.process_index() == 0:
            print(f"[train] {msg}", file=sys.stderr, flush=True)

    def _log_here(self, msg: str) -> None:
        """A log line from whichever process it concerns (a signal reaches one host)."""
        if self.verbose:
            where = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
            print(f"[train]{where} {msg}", file=sys.stderr, flush=True)

    def evaluate(self, params) -> float:
        return self.compiled.evaluate(params, self.plan.policy, self.policy_base)

    def _meta(self, step: int, status: str, skipped: int, time_s: float,
              segments: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.cfg
        return {"status": status, "samples": step * c.train.global_batch,
                "tokens": step * self.tokens_per_step, "epoch": self.loader.epoch(step),
                "skipped": skipped, "time_s": time_s, "policy_name": self.plan.policy_name,
                "config": c.to_dict(), "compat": self.compat,
                "execution": execution.record(self.plan, jax.device_count()), "segments": segments,
                **self.compiled.loader_record(self.loader, step)}

    def run(self) -> RunSummary:
        """Trains (or resumes) the run; returns its summary. XLA's out-of-memory becomes a
        `train.memory.RunOutOfMemory` naming the estimate and what would fit (the
        checkpoints written before it are intact)."""
        try:
            return self._run()
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.RunOutOfMemory(memory.out_of_memory_message(
                    self.plan, e, self._saved_note())) from None
            raise

    def _saved_note(self) -> str:
        """What the run directory holds to resume from (for an error message)."""
        if not self.cfg.checkpoint.enabled:
            return "Checkpoints are off (checkpoint.enabled: false): nothing to resume from."
        d = self.out / "checkpoints"
        try:
            with Checkpointer(d, keep=self.cfg.checkpoint.keep) as ck:
                latest = ck.latest_step()
        except Exception:  # noqa: BLE001 (the message must not fail on a damaged directory)
            latest = None
        if latest is None:
            return "No checkpoint was written before it: the same command starts over."
        return (f"The checkpoint of step {latest} in {d} is intact: the same command resumes "
                "from it once the settings fit.")

    def _run(self) -> RunSummary:
        c, t = self.cfg, self.cfg.train
        t_start = time.time()
        ckpt = None
        start, time_off, resumed, skipped = 0, 0.0, None, 0
        history: list[dict[str, Any]] = []  # the segments (processes) before this one
        if c.checkpoint.enabled:
            ckpt = Checkpointer(self.out / "checkpoints", keep=c.checkpoint.keep,
                                async_save=c.checkpoint.async_save)
        else:
            refuse_checkpoints_when_disabled(c)
            prev = check_reuse(self.out, c.to_dict(), steps=t.steps)
            if prev is not None:
                note = "run already complete; nothing to do"
                msg = prev.message if prev.message.startswith(note) else f"{note} ({prev.message})"
                return dataclasses.replace(relocated(prev, self.out), message=msg)
            if (self.out / "metrics.jsonl").exists():
                self._log(f"starting {self.out} over: the earlier run of this config did not "
                          "finish and checkpoints are off (checkpoint.enabled: false)")
        state, meta = None, None
        found = None
        if ckpt is not None:
            try:
                found = latest_resumable(ckpt, self.compat, self.plan.policy_name)
            except BaseException:
                ckpt.close()
                raise
        if found is not None:
            latest, meta = found
            try:
                state = ckpt.restore(latest, self.abs_state, meta)
                self.compiled.restore_loader(self.loader, meta, latest)
            except BaseException:
                ckpt.close()
                raise
            start, resumed = latest, latest
            time_off = float(meta.get("time_s", 0.0))
            history = earlier_segments(meta, latest)
            skipped = int(meta.get("skipped", 0))
            self._log(f"resuming from checkpoint step {latest} in {ckpt.directory}")
            changed = execution.changes(meta, execution.record(self.plan, jax.device_count()))
            if changed:
                self._log(f"notice: resuming with changed settings ({'; '.join(changed)}); they "
                          "change no state, so the run goes on, but the continuation is not "
                          "bit-identical to an uninterrupted run (sums are grouped "
                          "differently: about 1e-6 relative). Keep the old values for a "
                          "bit-identical continuation (docs/RELIABILITY.md)")
        done_status = meta.get("status") if meta else None
        already = resumed is not None and (
            resumed >= t.steps or (done_status == "target_reached"
                                   and meta["config"]["train"]["target_eval_loss"]
                                   == t.target_eval_loss))
        if self.read_only and not already:
            if ckpt is not None:
                ckpt.close()
            raise RunDirNotWritable(f"output directory {self.out} is not writable and the run "
                                    f"in it is not complete (checkpoint step {resumed} of "
                                    f"{t.steps}); fix the permissions or choose another --out")
        if already:
            if ckpt is not None:
                ckpt.close()
            prev = read_summary(self.out / "summary.json")
            if prev is not None and prev.steps == resumed:
                note = "run already complete; nothing to do"
                msg = prev.message if prev.message.startswith(note) else f"{note} ({prev.message})"
                return dataclasses.replace(relocated(prev, self.out), message=msg,
                                           resumed_from=resumed)
            return self._summary(done_status if done_status in ("completed", "target_reached")
                                 else "completed", "run already complete; nothing to do",
                                 resumed, skipped, history, resumed)
        if self.primary:
            (self.out / "config.yaml").write_text(yaml.safe_dump(c.to_dict(), sort_keys=False))
            self._metrics = MetricsWriter(self.out / "metrics.jsonl", resume_step=resumed)
            writer = Tee(self._metrics, *([TensorBoardWriter(self.out, resume_step=resumed)]
                                          if t.tensorboard else []))
            mll = mlperf.MLPerfLog(self.out / "mllog.txt", resume_step=resumed)
        else:  # other hosts of a multi-host run write nothing
            writer, mll = _Null(), _Null()
        self._log(f"run dir {self.out} | model {self.n_params / 1e6:.2f}M params | policy "
                  f"{self.plan.policy_name} | mesh data={self.plan.mesh_axes[0]} "
                  f"fsdp={self.plan.mesh_axes[1]} tensor={self.plan.mesh_axes[2]} | "
                  f"{self.compiled.data_summary()} | memory estimate "
                  f"{memory.gib(memory.for_plan(self.plan).total)} per device")
        self._routes = gemm_backend.route_record(self.plan.policy, c.backend)
        self._log(f"GEMM routes: {gemm_backend.describe_routes(self._routes)}")
        if resumed is None:
            mll.begin_init(mlperf.run_header(c, mlperf.plan_facts(
                self.plan, train_samples=self.compiled.train_samples,
                config_filename=str(self.out / "config.yaml"))))
        with shd.use_mesh(self.mesh), StopSignals(log=self._log_here) as signals:
            if state is None:
                try:
                    state = self.compiled.init_state(c.seed)
                except BaseException:  # e.g. out of memory: close the files (the loop
                    writer.close()     # closes them once it runs)
                    if ckpt is not None:
                        ckpt.close()
                    raise
                if c.model.init_from is not None:
                    self._log(f"parameters from the HF checkpoint {c.model.init_from} "
                              "(model.init_from); optimizer state fresh")
                mll.begin_run()
            return self._loop(state, start, resumed, skipped, time_off, t_start, ckpt, writer,
                              mll, signals, history)

    def _record(self, step: int, **kw: Any) -> dict[str, Any]:
        rec = {"step": step, "tokens": step * self.tokens_per_step, "loss": None,
               "eval_loss": None, "lr": None, "grad_norm": None, "tokens_per_s": None,
               "skipped_steps": 0, "policy": self.plan.policy_name,
               "epoch": round(self.loader.epoch(step), 4),
               **self.compiled.loader_metrics(self.loader)}
        rec.update(kw)
        return rec

    def _emit(self, writer: Tee, rec: dict[str, Any]) -> None:
        if self.hooks.on_record is not None:
            more = self.hooks.on_record(dict(rec))
            if more:
                rec.update(more)
        writer.write(rec)

    def _loop(self, state, start, resumed, skipped, time_off, t_start, ckpt, writer, mll,
              signals, history):
        c, t = self.cfg, self.cfg.train
        prog = Progress(t.steps, start=start,
                        mode=t.progress if self.verbose and jax.process_index() == 0 else "off")
        status, message = "completed", ""
        t_run = time.time()
        last_good = ckpt.last_good_step() if ckpt is not None else None
        step = start
        steady_t, steady_n = 0.0, 0
        saved, good = resumed, True  # the step the newest checkpoint holds; state not NaN-streaked

        def now() -> float:
            return time_off + time.time() - t_run

        def segments(at: int) -> list[dict[str, Any]]:
            """The run's segments up to step `at`: the earlier ones and this process's."""
            return [*history, segment_record(
                first_step=start, last_step=at, wall_s=time.time() - t_start,
                steady_steps=steady_n, steady_s=steady_t, tokens_per_step=self.tokens_per_step)]

        evaluated = False

        def do_eval(at: int) -> float:
            nonlocal evaluated
            if not evaluated:
                self._log(f"compiling the eval step (policy {self.plan.policy_name}) and "
                          f"evaluating {t.eval_sequences} sequences ...")
                te = time.time()
            loss = self.evaluate(state["params"])
            if not evaluated:
                self._log(f"first evaluation done in {time.time() - te:.1f} s")
                evaluated = True
            mll.evaluation(loss, step=at, samples=at * t.global_batch)
            return loss

        if start == 0 and t.eval_at_start:
            ev = do_eval(0)
            self._emit(writer, self._record(0, eval_loss=ev, time_s=round(now(), 3),
                                            lr=float(self.schedule(0))))
            prog.update(0, loss=None, tokens_per_s=None, eval_loss=ev)
        try:
            while step < t.steps:
                t0 = time.time()
                try:
                    with signals.interrupting():  # the pipeline may wait long, or spin
                        local, data_error = self.loader.batch(step), None
                except datamod.DataError as e:
                    local, data_error = None, e
                except StopRequested:  # signals.requested is set: saved and stopped below
                    local, data_error = None, None
                # Every process stops at the same step boundary, or none does.
                code = agree(max(STOP_SIGNAL if signals.requested else 0,
                                 STOP_DATA_ERROR if data_error is not None else 0,
                                 STOP_WRITE_FAILED if ckpt is not None and ckpt.failure() else 0))
                if code:
                    status, message = self._stop(code, step, state, ckpt, saved, good,
                                                 skipped, now(), signals.requested, data_error,
                                                 segments(step))
                    break
                mll.train_block(step=step + 1, samples=step * t.global_batch)
                batch = self.compiled.put(local)
                if step == start:  # the first call compiles (or loads from the compile cache)
                    self._log(f"compiling the train step (policy {self.plan.policy_name}) ...")
                tc = time.time()
                state, m = self._train_step(state, batch, self.policy_base)
                tc = time.time() - tc
                m = fetch(m)
                if step == start:
                    self._log(f"train step compiled in {tc:.1f} s; first step done in "
                              f"{time.time() - t0:.1f} s")
                step += 1
                dt = time.time() - t0
                if step > start + 1:
                    steady_t, steady_n = steady_t + dt, steady_n + 1
                tps = self.tokens_per_step / dt
                skipped = int(m["skipped"])
                loss = float(m["loss"])
                ev = None
                stop = False
                if int(m["consecutive"]) >= t.max_nonfinite:
                    status = "nonfinite"
                    where = (f"step {last_good} in {ckpt.directory}" if last_good is not None
                             else "none written")
                    message = (f"stopped at step {step}: {t.max_nonfinite} consecutive steps "
                               f"(steps {step - t.max_nonfinite + 1}-{step}) had a non-finite loss"
                               f" or gradient norm; their updates were skipped ({skipped} skipped "
                               f"in total). Last good checkpoint: {where}.")
                    stop = True
                elif (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                    ev = do_eval(step)
                    if t.target_eval_loss is not None and ev <= t.target_eval_loss:
                        status = "target_reached"
                        message = (f"eval loss {ev:.4f} <= target {t.target_eval_loss} at step "
                                   f"{step} ({step * self.tokens_per_step} tokens)")
                        stop = True
                if step % t.log_every == 0 or ev is not None or stop or step == t.steps:
                    rec = self._record(step, loss=loss, eval_loss=ev, lr=float(m["lr"]),
                                       grad_norm=float(m["grad_norm"]),
                                       tokens_per_s=round(tps, 1), skipped_steps=skipped,
                                       time_s=round(now(), 3))
                    if not bool(m["finite"]):
                        rec["nonfinite"] = True
                    if "extra" in m:
                        rec.update({k: np.asarray(v).tolist() for k, v in m["extra"].items()})
                    self._emit(writer, rec)
                prog.update(step, loss=loss, tokens_per_s=tps, eval_loss=ev, step_s=dt)
                good = int(m["consecutive"]) == 0  # not inside a non-finite streak
                if status == "nonfinite":
                    break
                final = stop or step == t.steps
                if ckpt is not None and (final or (c.checkpoint.every
                                                   and step % c.checkpoint.every == 0)):
                    st = status if final else "running"
                    ckpt.save(step, state, self._meta(step, st, skipped, now(), segments(step)),
                              good=good)
                    saved, last_good = step, step if good else last_good
                if stop:
                    break
        finally:
            prog.close()
            writer.close()
            if ckpt is not None:
                ckpt.close()
            # Last: after a stop signal raised inside the pipeline's read, stopping its
            # workers is the step most likely to wait; the metrics and the checkpoint are
            # on disk before it.
            self.loader.close()
        if status == "completed":
            message = (f"trained {step} step{'s' * (step != 1)} "
                       f"({step * self.tokens_per_step} tokens)")
        if status not in RESUMABLE_STOPS:  # a resumed run goes on in the same MLPerf log
            mll.end_run(success=status == "target_reached", step=step,
                        samples=step * t.global_batch)
        mll.close()
        return self._summary(status, message, step, skipped, segments(step), resumed)

    def _stop(self, code, step, state, ckpt, saved, good, skipped, now, signal_name,
              data_error, segments) -> tuple[str, str]:
        """(status, message) of a run stopped before step ``step + 1`` by `code` (see
        `train.preemption`), after saving the state of ``step`` unless a checkpoint holds it."""
        if code == STOP_WRITE_FAILED:
            failure = ckpt.failure() if ckpt is not None else None
            raise failure or CheckpointWriteError(
                "a checkpoint could not be written on another process of this run (see its "
                "error); training stopped. Fix that file system and run the same command again.")
        status = "data_error" if code == STOP_DATA_ERROR else "preempted"
        if ckpt is None:
            kept = "checkpoints are off (checkpoint.enabled: false): nothing to resume from"
        elif step == 0 and saved is None:
            kept = "no step was trained: nothing to save"
        else:
            if saved != step:
                ckpt.save(step, state, self._meta(step, status, skipped, now, segments),
                          good=good)
            kept = f"checkpoint step {step} in {ckpt.directory}"
        if code == STOP_DATA_ERROR:
            why = (str(data_error) if data_error is not None
                   else "a data error on another process of this run (see its log)")
            return status, (f"stopped after step {step}: {why}. Saved: {kept}; once the data "
                            "is fixed the same command resumes the run.")
        why = f"by {signal_name}" if signal_name else "by a signal to another process"
        return status, (f"preempted {why} after step {step}; {kept}. Run the same command "
                        "again to resume.")

    def _summary(self, status, message, step, skipped, segments, resumed) -> RunSummary:
        return summarize(self.cfg, policy_name=self.plan.policy_name, status=status,
                         message=message, step=step, tokens_per_step=self.tokens_per_step,
                         skipped=skipped, segments=segments, resumed=resumed,
                         primary=self.primary and not self.read_only,
                         routes=self._routes,
                         records=self._metrics.records if self._metrics is not None else None)
