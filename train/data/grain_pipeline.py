"""The grain datasets of the streaming loader (`train.data.stream`), one process's pipeline:
`ShardOrder` (the host's shards in a seeded order per epoch) -> `Chunks` (documents read in
`CHUNK_DOCS`-document chunks) -> `Tokenize` (a map, in the worker processes) -> `Pack`
(Megatron-style windows, in the training process). Every iterator's state is a small JSON
dict (see `train.data.stream` for what it holds and how a run resumes from it).

This module imports grain; `train.data.stream` imports it only when a stream is built
(grain is an optional dependency).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np
from absl import flags

from train.data.loader import epoch_permutation
from train.data.records import BadRecordLog, RecordReader, name_some
from train.data.sources import DataError
from train.data.tokenizer import TextTokenizer, load_hf

PROBLEMS_PER_CHUNK = 10  # skipped records' messages a chunk carries (all are counted)


def mark_absl_flags_parsed() -> None:
    """grain 0.2.18 reads an absl flag while starting worker processes and fails when the
    program never parsed absl flags (google/grain#1355, fixed after 0.2.18): mark them
    parsed (at their defaults) when nobody has."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@functools.lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int) -> np.ndarray:
    return epoch_permutation(n, seed, epoch)


class ShardOrder(grain.MapDataset):
    """Index k -> (epoch, path): the host's shards in a seeded order per epoch, forever."""

    def __init__(self, files: Sequence[str], seed: int):
        super().__init__()
        self._files, self._seed = tuple(files), int(seed)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, k = divmod(int(index), len(self._files))
        return epoch, self._files[int(_order(len(self._files), self._seed, epoch)[k])]

    def __str__(self) -> str:
        return f"ShardOrder({len(self._files)} files, seed={self._seed})"

class ChunkIterator(grain.DatasetIterator):
    """`Chunks`' iterator: its state is the shard (the parent's state before it) and line."""

    def __init__(self, parent, reader: RecordReader, chunk_docs: int, n_files: int):
        super().__init__(parent)
        self._reader, self._chunk_docs, self._n_files = reader, chunk_docs, n_files
        self._file_state = self._parent.get_state()  # the parent's state before the file
        self._file: tuple[int, str] | None = None
        self._records: Iterator | None = None
        self._line = 0
        self._file_docs = 0  # documents read from the open file
        # Files read to their end since the last document: once it holds every file,
        # no document can ever come (all empty, or no good record): an error, not a spin.
        self._barren: set[str] = set()
        self._last_problem: str | None = None  # the latest bad record, for that error

    def _open(self, skip: int) -> None:
        self._records = self._reader.records(self._file[1], skip)
        self._line, self._file_docs = skip, 0

    def _file_done(self) -> None:
        self._records = None
        if self._file_docs == 0:
            self._barren.add(self._file[1])
            if len(self._barren) >= self._n_files:
                raise DataError(
                    f"no document in any of this process's {self._n_files} shard(s): "
                    f"{name_some(sorted(self._barren))} (each is empty, blank lines, has "
                    "every text empty, or holds no good record); remove such shards from "
                    "data.sources or fix them"
                    + (f" (the latest bad record: {self._last_problem})"
                       if self._last_problem else ""))

    def __next__(self):
        while True:
            if self._records is None:
                self._file_state = self._parent.get_state()
                self._file = next(self._parent)
                self._open(0)
            docs, problems, n_problems, first = [], [], 0, self._line + 1
            while len(docs) < self._chunk_docs:
                try:
                    n, text, problem = next(self._records)
                except StopIteration:
                    self._file_done()
                    break
                self._line = n
                if problem is not None:
                    n_problems += 1
                    self._last_problem = problem
                    if len(problems) < PROBLEMS_PER_CHUNK:
                        problems.append(problem)
                elif text is not None:
                    docs.append(text)
                    self._file_docs += 1
                    self._barren.clear()
            if docs or n_problems:
                return {"docs": docs, "problems": problems, "n_problems": n_problems,
                        "epoch": self._file[0], "where": f"{self._file[1]}:{first}"}

    def get_state(self) -> dict[str, Any]:
        if self._records is None:
            return {"parent": self._parent.get_state(), "line": 0, "open": False}
        return {"parent": self._file_state, "line": self._line, "open": True}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._file_state = state["parent"]
        self._records = None
        if state["open"]:
            self._file = next(self._parent)
            self._open(int(state["line"]))

class Chunks(grain.IterDataset):
    """Chunks of up to `chunk_docs` documents read from the parent's shards."""

    def __init__(self, parent, reader: RecordReader, chunk_docs: int, n_files: int):
        super().__init__(parent)
        self._reader, self._chunk_docs, self._n_files = reader, chunk_docs, n_files

    def __iter__(self):
        return ChunkIterator(self._parent.__iter__(), self._reader, self._chunk_docs,
                             self._n_files)

class PackIterator(grain.DatasetIterator):
    """`Pack`'s iterator: its state is the chunk it is in and the offset into it."""

    def __init__(self, parent, seq_len: int):
        super().__init__(parent)
        self._T = seq_len
        self._entries: deque[list[Any]] = deque()  # [state before, bad before, tokens, epoch]
        self._skip = 0  # tokens of entries[0] already behind the next sequence's start
        self._avail = 0
        self._bad = 0  # records skipped in every chunk pulled so far
        self._epoch = 0
        self._log = BadRecordLog()

    def _pull(self) -> None:
        before = self._parent.get_state()
        el = next(self._parent)
        self._log.report(el["problems"], int(el["n_problems"]))
        self._entries.append([before, self._bad, el["tokens"], int(el["epoch"])])
        self._bad += int(el["n_problems"])
        self._avail += len(el["tokens"])

    def __next__(self) -> np.ndarray:
        T = self._T
        while self._avail - self._skip < T + 1:
            self._pull()
        out = np.empty(T + 1, np.uint32)
        filled, skip = 0, self._skip
        for _, _, toks, _ in self._entries:
            take = toks[skip:skip + T + 1 - filled]
            out[filled:filled + len(take)] = take
            filled += len(take)
            skip = 0
            if filled == T + 1:
                break
        self._epoch = self._entries[0][3]
        self._skip += T
        while self._skip >= len(self._entries[0][2]):
            self._skip -= len(self._entries[0][2])
            self._avail -= len(self._entries[0][2])
            self._entries.popleft()
        return out

    def get_state(self) -> dict[str, Any]:
        if not self._entries:
            return {"parent": self._parent.get_state(), "skip": 0, "bad": self._bad,
                    "epoch": self._epoch}
        head = self._entries[0]
        return {"parent": head[0], "skip": self._skip, "bad": head[1], "epoch": self._epoch}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._entries.clear()
        self._avail, self._skip = 0, 0
        self._bad, self._epoch = int(state["bad"]), int(state["epoch"])
        if state["skip"]:
            self._pull()
            self._skip = int(state["skip"])

    @property
    def bad_records(self) -> int:
        return self._bad

    @property
    def epoch(self) -> int:
        return self._epoch

class Pack(grain.IterDataset):
    """Megatron-style packing: ``seq_len + 1`` token windows overlapping by one."""

    def __init__(self, parent, seq_len: int):
        super().__init__(parent)
        self._T = seq_len

    def __iter__(self):
        return PackIterator(self._parent.__iter__(), self._T)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tokenize:
    """The worker-side map: a chunk's documents -> one uint32 token array (EOS after each
    document, BOS before it with `add_bos`). The tokenizer is loaded once per process."""

    tokenizer: str
    eos_token: str | None = None
    add_bos: bool = False

    @functools.cached_property
    def _tok(self) -> TextTokenizer:
        return load_hf(self.tokenizer, eos_token=self.eos_token, add_bos=self.add_bos)

    def __getstate__(self) -> dict[str, Any]:  # the tokenizer is rebuilt in each worker
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any]:
        docs = chunk.pop("docs")
        try:
            arrs = self._tok.encode_documents(docs) if docs else []
        except Exception as e:  # noqa: BLE001 (the reader refuses what it knows cannot encode)
            raise DataError(f"{chunk['where']}: the tokenizer failed on a document of the "
                            f"{len(docs)} from this line on ({type(e).__name__}: {e})") from None
        chunk["tokens"] = np.concatenate(arrs) if arrs else np.zeros((0,), np.uint32)
        return chunk


def worker_init(worker_index: int, worker_count: int, *, parent_pid: int) -> None:
    """Set up a grain worker process: one tokenizer thread, no signal handling of its own,
    and death with its parent."""
    # One core per worker: the Rust tokenizer would otherwise start a thread per core in
    # every worker (and per-worker throughput would not mean one process).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the terminal's whole process group, and SLURM signals every process of
    # a step: the trainer decides (it saves, then closes the workers); a worker's own
    # KeyboardInterrupt would print a traceback and leave shared memory behind.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(parent_pid)


def _watch_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """End this process once `parent_pid` is no longer its parent (the trainer was killed:
    SIGKILL runs no cleanup, and a worker left behind holds memory and the trainer's
    stdout/stderr). A thread polling the parent's pid rather than prctl(PR_SET_PDEATHSIG):
    grain starts its workers from helper threads, and that signal fires when the starting
    thread ends, not the process."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mxjax-parent-watch", daemon=True).start()
