"""The MLPerf-style events of a run (written through `train.metrics.MLLog`)."""

from __future__ import annotations

from train.config import Config
from train.metrics import MLLog


def log_run_start(mll: MLLog, config: Config, policy_name: str) -> None:
    """Submission and hyper-parameter events, then ``run_start`` (fresh runs only)."""
    c, t, o = config, config.train, config.optim
    mll.event("submission_benchmark", "llama31_8b" if c.model.preset == "llama3_8b" else c.name,
              step=0)
    for k, v in (("global_batch_size", t.global_batch),
                 ("max_sequence_length", c.data.seq_len),
                 ("gradient_accumulation_steps", c.accum_steps),
                 ("opt_base_learning_rate", o.lr),
                 ("opt_learning_rate_warmup_steps", o.warmup_steps),
                 ("opt_learning_rate_decay_steps", c.decay_steps),
                 ("opt_end_learning_rate", o.lr * o.final_lr_ratio),
                 ("opt_adamw_beta_1", o.b1), ("opt_adamw_beta_2", o.b2),
                 ("opt_adamw_epsilon", o.eps),
                 ("opt_adamw_weight_decay", o.weight_decay),
                 ("opt_gradient_clip_norm", o.clip_norm), ("seed", c.seed),
                 ("eval_samples", t.eval_sequences), ("target_accuracy", t.target_eval_loss),
                 ("precision_policy", policy_name)):
        mll.event(k, v, step=0)
    mll.event("run_start", step=0, event_type="INTERVAL_START")


def log_eval(mll: MLLog, eval_loss: float, *, step: int, global_batch: int) -> None:
    """``eval_start``, ``eval_accuracy`` (log-perplexity), ``eval_stop`` at `step`."""
    samples = step * global_batch
    mll.event("eval_start", step=step, samples_count=samples)
    mll.eval_accuracy(eval_loss, step=step, samples_count=samples)
    mll.event("eval_stop", step=step, samples_count=samples)


def log_run_stop(mll: MLLog, status: str, *, step: int, config: Config) -> None:
    """``run_stop``: success when the target was reached, aborted when stopped by the
    non-finite guard or when a set target was missed, else completed."""
    t = config.train
    mll.event("run_stop", step=step, event_type="INTERVAL_END",
              status="success" if status == "target_reached" else
              ("aborted" if status == "nonfinite" or t.target_eval_loss is not None
               else "completed"), samples_count=step * t.global_batch)
