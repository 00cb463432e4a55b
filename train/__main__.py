"""Command line: ``python -m train --config configs/tiny.yaml [options]``.

Subcommands (`train.commands`): ``python -m train export-hf RUN_DIR OUT_DIR`` and
``python -m train mlperf-check RUN_DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import jax
import yaml

from mxjax import policies
from train import check, loop, memory
from train import config as cfgmod
from train.checkpoint import CheckpointError, CheckpointWriteError
from train.commands import SUBCOMMANDS
from train.config import ConfigError
from train.data import DataError
from train.preemption import PREEMPTED_EXIT
from train.process import INIT_TIMEOUT_EXIT, DistributedInitError
from train.run_lock import RunLockError

_EPILOG = """\
subcommands (each with its own --help):
  python -m train export-hf RUN_DIR OUT_DIR [--step N]   a checkpoint as an HF Llama directory
  python -m train mlperf-check RUN_DIR                    MLPerf compliance check of mllog.txt

what a run writes (in --out, default runs/<name>):
  config.yaml     the resolved config
  metrics.jsonl   one JSON record per step: step, tokens, loss, eval_loss, lr,
                  grad_norm, tokens_per_s, skipped_steps, policy, epoch, time_s
  mllog.txt       the MLPerf Training log (mlperf_logging.mllog; eval_accuracy =
                  validation log-perplexity, with samples_count)
  events.out.tfevents.*  TensorBoard scalars (tensorboard --logdir runs/)
  plot.png        train and eval loss against tokens
  checkpoints/    orbax checkpoints (last checkpoint.keep kept)
  summary.json    final status, eval history, tokens/s, wall time
Re-running the same command resumes from the last checkpoint; a finished run
returns at once. A checkpoint from another model/policy/data/optimizer setup,
or a damaged one, is an error (never a silent fresh start).

policies: --policy NAME (see --list-policies) or `policy:` in the config
(a name, a full policy dict, or null for no policy).

One live run per output directory: a second run on it while the first is alive
is refused (naming the holder's host and pid); a directory left by a killed run
is taken over. A complete run in a read-only directory is reported (exit 0).

SIGTERM or Ctrl-C (SIGINT): the run finishes its step, saves a checkpoint,
writes its metrics and summary (status: preempted) and exits 75; the same
command resumes it bit-identically. A second signal exits at once.

exit codes:
  0   done (all steps, or the target eval loss reached; also a finished run re-run)
  1   an unexpected error (a bug: please report the traceback)
  2   configuration error (reported before anything compiles)
  3   stopped by the non-finite guard (train.max_nonfinite steps in a row)
  4   checkpoint unreadable, damaged or from another setup
  5   output directory in use by another run, not writable, or holding files of a
      run's names (config.yaml, metrics.jsonl, ...) that no run wrote
  6   a file could not be written or read (disk full, read-only or failing file
      system): a checkpoint, the data cache, the metrics
  7   damaged prepared data (a .bin of the wrong size, token ids outside the
      vocabulary); a checkpoint of the last good step is saved first
  8   --distributed: no cluster found, or not every process joined in
      mesh.init_timeout_s
  9   out of device memory (one message: the memory estimate and what would fit;
      the last checkpoint is intact). --check exits 2 when the estimate exceeds a
      device's memory (docs/RELIABILITY.md)
  75  preempted: stopped by SIGTERM/SIGINT after saving a checkpoint
  130, 143  interrupted outside training, or by a second SIGINT/SIGTERM

config keys (set in the YAML file or with --set section.key=value):
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m train",
        description="Pretrain a Llama model under an mxjax precision policy.",
        epilog=_EPILOG + cfgmod.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config file (e.g. configs/tiny.yaml); without it "
                    "the defaults below are used")
    ap.add_argument("--policy", help="precision policy (overrides the config's policy): what "
                    "mxjax.policies.resolve takes: a preset name (--list-policies), "
                    "'<name>@<backend>', 'none', or a policy dict as JSON/YAML, e.g. "
                    "'{fprop: mxfp4, dgrad: null}'")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.steps=200 --set "
                    "model.overrides.n_layers=2 (value parsed as YAML; repeatable)")
    ap.add_argument("--out", help="output directory (overrides out_dir; default runs/<name>)")
    ap.add_argument("--distributed", action="store_true",
                    help="call jax.distributed.initialize() (multi-host; same as "
                    "mesh.distributed=true)")
    ap.add_argument("--check", action="store_true",
                    help="print the memory estimate (from the model, mesh and micro-batch "
                    "alone), validate the config, prepare the data, compare with the "
                    "checkpoints in --out, and exit with the code the run would (nothing is "
                    "compiled; train/check.py)")
    ap.add_argument("--devices", type=int, metavar="N",
                    help="with --check: plan for N devices (default: this host's)")
    ap.add_argument("--chip", metavar="NAME",
                    help="with --check: devices of this chip, which the host need not have "
                    "(h100, h200, b200, gb200, v4, v5e, v5p, v6e)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config as YAML and exit")
    ap.add_argument("--list-policies", action="store_true",
                    help="list the policy presets, one line each (name - what it is), and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress or log lines")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    if args.list_policies:
        print(_policy_list())
        return 0
    try:
        # before anything else: --print-config and a multi-host start would ignore them
        if (args.devices is not None or args.chip is not None) and not args.check:
            raise ConfigError("--devices and --chip ask --check about other hardware; "
                              "add --check (a run uses the devices it has)")
        raw = cfgmod.read_yaml(args.config) if args.config else {}
        raw = cfgmod.apply_overrides(raw, args.set)
        if args.policy is not None:
            raw["policy"] = cfgmod.policy_argument(args.policy)
        if args.out is not None:
            raw["out_dir"] = args.out
        if args.distributed:
            raw.setdefault("mesh", {})["distributed"] = True
        cfg = cfgmod.from_dict(raw)
        if args.print_config:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if cfg.mesh.distributed:
            loop.init_distributed(cfg.mesh, verbose=not args.quiet)
        if args.check:
            report, findings = check.check(cfg, devices=args.devices, chip=args.chip,
                                           verbose=not args.quiet)
            print(json.dumps(report, indent=1))
            for f in findings:
                print(f.line, file=sys.stderr)
            return findings[0].exit_code if findings else 0
        summary = loop.run(cfg, verbose=not args.quiet)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointWriteError as e:
        print(f"checkpoint write error: {e}", file=sys.stderr)
        return 6
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 4
    except RunLockError as e:
        print(f"output directory error: {e}", file=sys.stderr)
        return 5
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 7
    except memory.RunOutOfMemory as e:
        print(f"out of memory: {e}", file=sys.stderr)
        return memory.OOM_EXIT
    except DistributedInitError as e:
        print(f"distributed setup error: {e}", file=sys.stderr)
        return INIT_TIMEOUT_EXIT
    except OSError as e:  # environmental, not a bug: the message names the file
        print(f"I/O error: {e}", file=sys.stderr)
        return 6
    except KeyboardInterrupt:  # Ctrl-C before training started (training handles its own)
        print("interrupted (outside the training loop, which saves on SIGINT/SIGTERM: nothing "
              "of the run is lost)", file=sys.stderr)
        return 130
    if jax.process_index() == 0:
        s = summary
        print(f"status: {s.status} ({s.message})")
        tps = f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "n/a"
        if not s.eval_history:
            ev = "no eval loss in"
        elif s.eval_history[-1][0] == s.steps:
            ev = f"final eval loss: {s.eval_history[-1][2]:.4f} after"
        else:  # e.g. stopped by the non-finite guard: the last eval is older than the state
            ev = (f"last eval loss: {s.eval_history[-1][2]:.4f} at step {s.eval_history[-1][0]}"
                  ", none after it; stopped after")
        print(f"{ev} {s.steps} step{'s' * (s.steps != 1)} / {s.tokens} tokens; wall time "
              f"{s.wall_time_s:.1f}s; {tps} tokens/s; skipped steps: {s.skipped_steps}")
        if s.segments and len(s.segments) > 1:  # resumed: the figures above are the whole run's
            g = s.segments[-1]
            gtps = f"{g['tokens_per_s']:,.0f}" if g["tokens_per_s"] else "n/a"
            print(f"this segment (steps {g['first_step']}-{g['last_step']}, {len(s.segments)} in "
                  f"all): wall time {g['wall_time_s']:.1f}s; {gtps} tokens/s")
        print(f"metrics: {s.metrics_path}")
        if s.plot_path:
            print(f"plot: {s.plot_path}")
        if s.checkpoint_dir:
            print(f"checkpoints: {s.checkpoint_dir}")
        print(f"summary: {s.out_dir}/summary.json")
    return _EXIT_BY_STATUS.get(summary.status, 0)


def _policy_list() -> str:
    """One line per preset: name - what it is (--list-policies)."""
    rows = [("none", "no policy: every GEMM a plain lax.dot_general (as passthrough)")]
    rows += [(n, policies.summary(n)) for n in policies.names()]
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"{n.ljust(width)}  {what}" for n, what in rows)


_EXIT_BY_STATUS = {"nonfinite": 3, "data_error": 7, "preempted": PREEMPTED_EXIT}


if __name__ == "__main__":
    sys.exit(main())
