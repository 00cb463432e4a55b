"""The streaming input pipeline (``data.loader: grain``): shards in, packed batches out.

For corpora too large to tokenize once before step 0 (C4: 1024 ``json.gz`` shards,
~156B tokens), this reads the source shards as they are, tokenizes in grain worker
processes and packs on the fly; nothing reads the corpus before the first batch.

The pipeline of one process (host), in order:

1. **Shards.** The resolved ``data.sources`` (sorted within each glob, in the order
   given) are split across hosts: process ``i`` of ``n`` reads ``files[i::n]``
   (`host_shards`: disjoint, and together complete). Each host reads its shards in a
   per-epoch order fixed by the seed (`train.data.loader.epoch_permutation`), epoch
   after epoch, forever.
2. **Chunks** (in the workers). Each shard is read line by line (C4 JSONL, ``.gz`` or
   not) or row by row (parquet, through pyarrow); every ``CHUNK_DOCS`` documents form
   one chunk, tokenized with the HF ``tokenizer.json`` (each document followed by EOS,
   preceded by BOS with ``data.add_bos``) into one uint32 array. With
   ``data.workers: W > 0`` grain's ``mp_prefetch`` runs W processes; worker ``w`` reads
   shards ``w, w+W, ...`` of the host's order and the output takes one chunk from each
   worker in turn. The order is therefore fixed by (files, seed, process count,
   workers): ``workers: 0`` (in the training process) gives the order of ``workers: 1``.
3. **Packing** (in the training process), Megatron-style as in the prepared path:
   the chunks' tokens are one stream, cut into sequences of ``seq_len + 1`` tokens
   overlapping by one (sequence i is ``stream[i*T : i*T + T + 1]``), no masking at
   document boundaries. A process's rows of a step are its next ``global_batch / n``
   sequences.

Exact resume: the iterator's state (the shard and line each worker is at, which worker
is next, the token offset into the chunk the packer is in) is a small JSON dict;
`StreamLoader.state_for` gives the state before any step's batch and `restore`
reopens the stream there (re-reading the current shard up to its line). The trainer
stores every process's state in the checkpoint's record (`gather_states`).

Bad records: a corrupt gzip stream, invalid UTF-8, a bad or too deeply nested JSON line,
a missing text field, a text with a lone surrogate (no tokenizer takes it) or an
unreadable parquet row group raises `DataError` naming the file and line
(``data.on_bad_record: error``, the default). With ``skip`` the record is skipped (the
rest of the shard for a corrupt gzip stream, which cannot be read past; the row group for
parquet), reported on stderr (`BadRecordLog`: the first few one by one, then counts) and
counted (`StreamLoader.bad_records`, the ``data_bad_records`` metric). Once a reader has
read every one of its files through without a document since its last one, no document
can come: a `DataError` naming them, not an endless loop (`probe_shards`, run by
``--check`` and at every start, names such shards first).

Workers ignore SIGINT/SIGTERM (the trainer saves, then closes them) and end themselves when
the training process is gone (`_watch_parent`). In the training process a Ctrl-C that
comes while the loader is inside grain (reading a batch, taking or setting a state,
closing) raises its KeyboardInterrupt when that call has returned, not inside it
(`train.preemption.interrupts_held`): raised mid-call it could leave grain's queues and
locks half-used, and the `close` that follows could wait on them. A second Ctrl-C raises
at once.

The pieces live in their own modules: `train.data.records` reads a shard's documents,
`train.data.grain_pipeline` holds the grain datasets of steps 1-3 (imported only when a
stream is built: grain is optional); this module has the spec, the loader (a
`train.data.loader.BatchLoader`), the checks and the fingerprint.

Validation (`validation_tokens`): the first documents of ``data.val_sources``, read in
order in the training process until ``eval_sequences`` packed sequences are full: the
same set whatever the number of hosts (each takes its rows of every eval batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.config import ConfigError, DataSection
from train.data.records import (  # noqa: F401 (re-exported: the stream's public names)
    REPORTED_BAD_RECORDS,
    RecordReader,
    name_some,
    probe_shards,
    require_pyarrow,
    shard_format,
    unencodable,
)
from train.data.sources import DataError, resolve_sources
from train.data.tokenizer import TextTokenizer, TokenizerError, load_hf
from train.preemption import interrupts_held

# grain's `min_shm_size` above which arrays go through shared memory: larger than any chunk.
_NO_SHARED_MEMORY = 1 << 62


CHUNK_DOCS = 64  # documents per tokenized chunk (part of the data order: in the fingerprint)
STATE_VERSION = 1


# ------------------------------------------------------------------------------ shards

def host_shards(files: Sequence[Any], process_index: int, process_count: int) -> list[Any]:
    """The shards process `process_index` of `process_count` reads: ``files[i::n]``.

    Over all processes the lists are disjoint and together hold every file once.
    Raises ConfigError when there are fewer files than processes (a host with nothing to
    read).
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    if len(files) < process_count:
        raise ConfigError(f"data.sources: {len(files)} file(s) for {process_count} processes; "
                          "the grain loader gives each process whole shards, so it needs at "
                          "least one file per process")
    return list(files[process_index::process_count])


def _pipeline() -> Any:
    """`train.data.grain_pipeline`, which imports grain (an optional dependency)."""
    try:
        from train.data import grain_pipeline
    except ImportError as e:
        if e.name is None or not e.name.startswith(("grain", "absl")):
            raise
        raise ConfigError("data.loader: 'grain' needs the grain package, which is not "
                          "installed (pip install grain, or the project's 'train' extra)"
                          ) from None
    grain_pipeline.mark_absl_flags_parsed()
    return grain_pipeline


# ------------------------------------------------------------------------- the spec

@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """Everything one process's training stream depends on (see the module docstring).

    files: this process's shards (`host_shards`); workers: grain worker processes
    (0: in this process).
    """

    files: tuple[str, ...]
    seed: int
    seq_len: int
    tokenizer: str
    eos_token: str | None = None
    add_bos: bool = False
    text_key: str = "text"
    on_bad_record: str = "error"
    workers: int = 0
    chunk_docs: int = CHUNK_DOCS

    def __post_init__(self):
        if not self.files:
            raise ConfigError("data.sources: no shard for this process")
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.workers < 0:
            raise ConfigError(f"data.workers must be >= 0, got {self.workers}")
        if self.on_bad_record not in ("error", "skip"):
            raise ConfigError(f"data.on_bad_record must be 'error' or 'skip', got "
                              f"{self.on_bad_record!r}")

    def chunk_dataset(self) -> Any:
        """The grain `IterDataset` of tokenized chunks before packing: dicts with 'tokens'
        (uint32), 'problems' (skipped records), 'epoch' and 'where' (file:first line)."""
        gp = _pipeline()
        reader = RecordReader(text_key=self.text_key, on_bad_record=self.on_bad_record)
        it = gp.ShardOrder(self.files, self.seed).to_iter_dataset()
        it = gp.Chunks(it, reader, self.chunk_docs, len(set(self.files)))
        it = it.map(gp.Tokenize(tokenizer=self.tokenizer, eos_token=self.eos_token,
                                add_bos=self.add_bos))
        if self.workers:
            # Chunks reach the trainer pickled, never in shared memory: a chunk is a few
            # token arrays (copying them costs nothing beside tokenizing), and a segment in
            # flight when the trainer stops (Ctrl-C, preemption) would outlive it, leaked.
            it = gp.grain.experimental.WithOptionsIterDataset(
                it, gp.grain.experimental.DatasetOptions(min_shm_size=_NO_SHARED_MEMORY))
            it = it.mp_prefetch(gp.grain.MultiprocessingOptions(num_workers=self.workers),
                                worker_init_fn=functools.partial(gp.worker_init,
                                                                 parent_pid=os.getpid()))
        return it

    def dataset(self) -> Any:
        """The grain `IterDataset` of packed sequences (uint32[seq_len + 1])."""
        return _pipeline().Pack(self.chunk_dataset(), self.seq_len)


def spec_for_process(data: DataSection, seed: int, process_index: int,
                     process_count: int) -> StreamSpec:
    """The `StreamSpec` of one process of a run with the data section `data`."""
    files = [str(p) for p in resolve_sources(data.sources)]
    return StreamSpec(files=tuple(host_shards(files, process_index, process_count)), seed=seed,
                      seq_len=data.seq_len, tokenizer=data.tokenizer, eos_token=data.eos_token,
                      add_bos=data.add_bos, text_key=data.text_key,
                      on_bad_record=data.on_bad_record, workers=data.workers)


# ------------------------------------------------------------------------- the loader

class StreamLoader:
    """This process's rows of every global batch, read from the grain stream in step order.

    ``batch(step)`` must be called for consecutive steps (it streams: the first call is
    step 0, or the step `restore` was given). ``state_for(step)`` is the JSON state after
    which the next batch is `step`'s; ``restore(state, step)`` continues from it.
    Token ids at or above `vocab_size` raise DataError.
    """

    def __init__(self, spec: StreamSpec, *, global_batch: int, process_count: int = 1,
                 process_index: int = 0, vocab_size: int | None = None):
        if global_batch % process_count:
            raise ConfigError(f"train.global_batch ({global_batch}) must be divisible by the "
                              f"number of processes ({process_count})")
        self.spec, self.local = spec, global_batch // process_count
        self.process_index, self.process_count = process_index, process_count
        self.vocab_size = vocab_size
        self._ds = spec.dataset()
        self._it: Any = None
        self._next = 0
        self._before: tuple[int, dict[str, Any]] | None = None

    def _iter(self) -> Any:
        if self._it is None:
            self._it = self._ds.__iter__()
        return self._it

    def batch(self, step: int) -> np.ndarray:
        """int32[local batch, seq_len + 1] for `step` (the next step of the stream)."""
        if step != self._next:
            raise RuntimeError(f"the grain loader streams: the next batch is step {self._next}'s,"
                               f" not step {step}'s (restore a state to move)")
        with interrupts_held():
            return self._read(step)

    def _read(self, step: int) -> np.ndarray:
        it = self._iter()
        if self._before is None or self._before[0] != step:
            self._before = (step, it.get_state())
        try:
            rows = np.stack([next(it) for _ in range(self.local)])
        except DataError as e:  # grain appends a note on its traceback filtering: dropped
            raise DataError(_worker_message(e)) from None
        except Exception as e:
            # a worker's DataError may come back under another type; keep its message
            if "DataError" in f"{type(e).__name__} {e}":
                raise DataError(_worker_message(e)) from None
            raise
        if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:
            r, c = (int(v) for v in np.argwhere(rows >= self.vocab_size)[0])
            raise DataError(f"token id {int(rows[r, c])} at position {c} of row {r} of step "
                            f"{step} is outside the model's vocabulary [0, {self.vocab_size}) "
                            f"(data.tokenizer {self.spec.tokenizer})")
        self._next = step + 1
        return rows.astype(np.int32)

    def state_for(self, step: int) -> dict[str, Any]:
        """The JSON state from which the next batch read is `step`'s."""
        if self._before is not None and self._before[0] == step:
            inner = self._before[1]
        elif step == self._next:
            with interrupts_held():
                inner = self._iter().get_state()
        else:
            raise RuntimeError(f"no loader state for step {step} (next step {self._next})")
        return {"version": STATE_VERSION, "step": int(step), "shards": self.shards_digest(),
                "iterator": inner}

    def shards_digest(self) -> str:
        """A digest of this process's shard list (names, in order): which shards a state is of."""
        return shards_digest(self.spec.files)

    def restore(self, state: dict[str, Any], step: int) -> None:
        """Continue the stream from `state` (a `state_for(step)` of the same setup)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError("the checkpoint's data-loader state is missing or of another "
                            "version; it cannot be resumed exactly")
        if int(state["step"]) != step:
            raise DataError(f"the checkpoint's data-loader state is for step {state['step']}, "
                            f"not {step}")
        if state.get("shards") != self.shards_digest():
            raise DataError("the checkpoint's data-loader state is of another list of shards "
                            "for this process; it cannot be resumed exactly")
        self.close()
        with interrupts_held():
            self._it = self._ds.__iter__()
            self._it.set_state(state["iterator"])
            self._next, self._before = step, None

    def checkpoint_record(self, step: int) -> dict[str, Any]:
        """What a checkpoint at `step` records: every process's stream state
        (``data_state``; a collective on several processes)."""
        return {"data_state": gather_states(self.state_for(step))}

    def resume(self, record: Mapping[str, Any], step: int) -> None:
        """Continue from the checkpoint of `step` whose record is `record` (this process's
        state among ``data_state``)."""
        states = record.get("data_state")
        pc = self.process_count
        if not isinstance(states, list) or len(states) != pc:
            have = len(states) if isinstance(states, list) else "no"
            raise DataError(f"checkpoint step {step} holds {have} data-loader states "
                            f"for {pc} processes; it cannot be resumed exactly")
        self.restore(states[self.process_index], step)

    def metrics(self) -> dict[str, Any]:
        """``data_bad_records``: the records skipped over every process (a collective on
        several processes)."""
        return {"data_bad_records": sum_over_processes(self.bad_records)}

    @property
    def bad_records(self) -> int:
        """Records skipped so far (``data.on_bad_record: skip``) in the chunks read."""
        return int(self._it.bad_records) if self._it is not None else 0

    def epoch(self, step: int) -> float:
        """The epoch (pass over this host's shards) the stream is in; `step` is unused."""
        return float(self._it.epoch) if self._it is not None else 0.0

    def close(self) -> None:
        """Stop the worker processes (also done at garbage collection)."""
        it, self._it = self._it, None
        if it is not None:
            with interrupts_held(), contextlib.suppress(Exception):
                _close_tree(it)


def shards_digest(files: Sequence[str]) -> str:
    """16 hex digits of SHA-256 over the shards' file names, in order."""
    return hashlib.sha256("\n".join(Path(f).name for f in files).encode()).hexdigest()[:16]


def _close_tree(it: Any) -> None:
    stack = [it]
    while stack:
        cur = stack.pop()
        close = getattr(cur, "close", None)
        if callable(close):
            close()
        stack.extend(getattr(cur, "_parents", ()))


def _worker_message(e: BaseException) -> str:
    """The DataError's own message, without what grain adds around it."""
    text = str(e).split("\n--------------------\nFor simplicity, Grain", 1)[0].strip()
    for line in reversed(text.splitlines()):
        if "DataError: " in line:
            return line.split("DataError: ", 1)[1]
    return text


# ---------------------------------------------------------------- states of processes

def gather_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's loader state, in process order (a collective on several processes;
    on one, ``[state]``)."""
    import jax

    if jax.process_count() == 1:
        return [state]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(state, sort_keys=True).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:raw.size] = raw
    allb = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [json.loads(allb[i, :int(sizes[i])].tobytes()) for i in range(len(sizes))]


def sum_over_processes(value: int) -> int:
    """The sum of `value` over processes (a collective on several processes)."""
    import jax

    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.int64(value))))


# ---------------------------------------------------------------- checks, validation

def _digest_bytes(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_stream(data: DataSection) -> list[Path]:
    """The ``--check`` checks of a grain data section (no document is read): the sources
    and validation sources exist (a glob matching nothing or a listed file that is absent
    is a ConfigError naming it), every file has a format the stream reads (parquet needs
    pyarrow), the tokenizer is a readable HF tokenizer.json. Returns the sources."""
    if data.tokenizer == "bpe":
        raise ConfigError("data.tokenizer: data.loader grain tokenizes with a Hugging Face "
                          "tokenizer.json (a path); the trained 'bpe' tokenizer needs "
                          "data.loader: prepared. For your own text, python -m train.data "
                          "tokenizer --source FILES --vocab-size N --out tokenizer.json "
                          "writes one (docs/DATA.md)")
    if not data.val_sources:
        raise ConfigError("data.val_sources: data.loader grain needs a validation file (e.g. "
                          "C4's c4-validation_24567exp.json); holding out part of the sources "
                          "is the prepared loader's")
    if data.format == "text":
        raise ConfigError("data.format: 'text' is data.loader prepared's; the grain loader reads "
                          "JSON lines (C4) and parquet")
    files = resolve_sources(data.sources)
    vals = resolve_sources(data.val_sources, "data.val_sources")
    for what, group in (("data.sources", files), ("data.val_sources", vals)):
        for p in group:
            try:
                kind = shard_format(p)
            except DataError as e:
                raise ConfigError(f"{what}: {e}") from None
            if kind == "parquet":
                require_pyarrow(what)
    if not Path(data.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer: file not found: {data.tokenizer}")
    try:
        load_hf(data.tokenizer, eos_token=data.eos_token, add_bos=data.add_bos)
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    return files


SAMPLE_BLOCK = 4096  # bytes of each sampled block of a file (`sample_digest`)
SAMPLE_BLOCKS = 8  # blocks sampled per file: the first, the last and 6 evenly between


def sample_digest(path: Path, size: int) -> str:
    """16 hex digits of SHA-256 over `SAMPLE_BLOCKS` blocks of `SAMPLE_BLOCK` bytes spread
    over the file (the first and the last among them): a cheap check that a shard is the
    one a checkpoint was written on (32 KiB read per file, not the whole shard). Any edit
    of a gzip file changes its last 8 bytes (CRC-32 and length of the content), so an edited
    ``.gz`` shard is always noticed; in an uncompressed file an edit that keeps the size and
    misses every sampled block is not."""
    h = hashlib.sha256()
    span = max(size - SAMPLE_BLOCK, 0)
    offsets = sorted({span * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)})
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()[:16]


def file_listing(paths: Sequence[Path]) -> list[list[Any]]:
    """``[name, size, sample_digest]`` of each file, in order (a checkpoint's record of the
    shards it was written on, to say which changed)."""
    out = []
    for p in paths:
        size = p.stat().st_size
        out.append([p.name, size, sample_digest(p, size)])
    return out


def stream_fingerprint(data: DataSection, process_count: int) -> dict[str, Any]:
    """What a grain run's data order depends on besides the seed (a checkpoint must match
    it to resume): each key is the ``data.*`` key (or fact) it comes from. The sources are
    compared by file names and sizes (``sources``, ``val_sources``) and by ``files``: each
    file's name, size and `sample_digest`, which also names what changed (see
    `train.compat.check_compatible`); nothing reads the shards whole."""
    files = [p for p in resolve_sources(data.sources)]
    vals = resolve_sources(data.val_sources, "data.val_sources")

    def listing(ps: list[Path]) -> str:
        text = "\n".join(f"{p.name}\t{p.stat().st_size}" for p in ps)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return {"loader": "grain", "sources": listing(files), "n_sources": len(files),
            "val_sources": listing(vals), "tokenizer": _digest_bytes(data.tokenizer)[:16],
            "eos_token": data.eos_token, "add_bos": data.add_bos, "text_key": data.text_key,
            "on_bad_record": data.on_bad_record, "workers": data.workers,
            "chunk_docs": CHUNK_DOCS, "seq_len": data.seq_len, "process_count": process_count,
            "files": {"sources": file_listing(files), "val_sources": file_listing(vals)}}


def file_changes(old: Sequence[Sequence[Any]], new: Sequence[Sequence[Any]]) -> list[str]:
    """What differs between two `file_listing`s: files added, removed, changed (size or
    content), or the same files in another order; [] when equal."""
    o = {str(e[0]): tuple(e[1:]) for e in old}
    n = {str(e[0]): tuple(e[1:]) for e in new}
    out = []
    if added := [k for k in n if k not in o]:
        out.append(f"added {name_some(added)}")
    if removed := [k for k in o if k not in n]:
        out.append(f"removed {name_some(removed)}")
    changed = [k for k in n if k in o and n[k] != o[k]]
    if changed:
        sizes = ", ".join(f"{k} ({o[k][0]} -> {n[k][0]} bytes)" if o[k][0] != n[k][0]
                          else f"{k} (same size, other content)" for k in changed[:8])
        more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
        out.append(f"changed {sizes}{more}")
    if not out and [str(e[0]) for e in old] != [str(e[0]) for e in new]:
        out.append("the same files in another order")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamData:
    """What validating a grain data section found (`train.plan.Plan.stream`).

    vocab_size: the tokenizer's; n_sources: training shards over all hosts;
    val_tokens: the validation stream's first tokens (`validation_tokens`).
    """

    vocab_size: int
    n_sources: int
    val_tokens: np.ndarray


def validation_tokens(data: DataSection, n_sequences: int, *,
                      tokenizer: TextTokenizer | None = None, batch_docs: int = 256) -> np.ndarray:
    """The token stream of the first documents of ``data.val_sources``, in order, just long
    enough for `n_sequences` packed sequences (``n * seq_len + 1`` tokens; shorter when the
    files end first). Bad records follow ``data.on_bad_record``."""
    tok = tokenizer or load_hf(data.tokenizer, eos_token=data.eos_token, add_bos=data.add_bos)
    need = n_sequences * data.seq_len + 1
    reader = RecordReader(text_key=data.text_key, on_bad_record=data.on_bad_record)
    parts: list[np.ndarray] = []
    have = 0
    pending: list[str] = []

    def flush() -> None:
        nonlocal have
        for a in tok.encode_documents(pending):
            parts.append(a)
            have += a.size
        pending.clear()

    for path in resolve_sources(data.val_sources, "data.val_sources"):
        for _, text, problem in reader.records(str(path)):
            if problem is not None:
                print(f"[data] skipped a bad validation record: {problem}", file=sys.stderr,
                      flush=True)
            if text is None:
                continue
            pending.append(text)
            if len(pending) >= batch_docs:
                flush()
                if have >= need:
                    break
        if have >= need:
            break
    if pending:
        flush()
    out = np.concatenate(parts) if parts else np.zeros((0,), np.uint32)
    return out[:need]
