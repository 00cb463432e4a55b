"""Packing and loading: sequences cut from a token stream, the shuffle, batches.

Megatron-style packing (sequences of ``seq_len + 1`` tokens overlapping by one,
no masking at document boundaries); the training order is a per-epoch
permutation from the seed (splitmix64, independent of the NumPy version), and
the loader's only state is the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from train.config import ConfigError
from train.data.sources import DataError


class Sequences:
    """Packed view of a token stream: sequence i = tokens[i*T : i*T + T + 1].

    With ``vocab_size``, every batch read is checked on the host: a token id at or
    above it (a damaged ``.bin`` or a model built for a smaller vocabulary) raises
    DataError naming the sequence (and ``source``, the file the stream came from),
    instead of reaching the model.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, vocab_size: int | None = None,
                 source: str | Path | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.source = source
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def take(self, idx: np.ndarray) -> np.ndarray:
        """int32[len(idx), seq_len + 1] for sequence indices `idx`."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"sequence index out of range [0, {self.n})")
        pos = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
        out = np.asarray(self.tokens[pos])
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row, col = (int(v) for v in np.argwhere(out >= self.vocab_size)[0])
            where = f"{self.source}: " if self.source is not None else ""
            fix = (f"; the file is damaged: delete {Path(self.source).parent} and prepare again"
                   if self.source is not None else "")
            raise DataError(f"{where}token id {int(out[row, col])} at position {col} of "
                            f"sequence {int(idx[row])} (stream offset {int(pos[row, col])}) is "
                            f"outside the vocabulary [0, {self.vocab_size}){fix}")
        return out.astype(np.int32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) fixed by (seed, epoch), stable across NumPy versions."""
    base = _splitmix64(np.array([(seed & 0xFFFFFFFF) << 32 | (epoch & 0xFFFFFFFF)], np.uint64))[0]
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(n, dtype=np.uint64) ^ base)
    return np.argsort(keys, kind="stable")


class BatchLoader(Protocol):
    """What the trainer reads its batches through: `TrainLoader` (prepared data) and
    `train.data.stream.StreamLoader` (``data.loader: grain``) both are one.

    ``batch(step)``: this process's rows int32[b_local, seq_len + 1] of step `step`'s global
    batch (a DataError for damaged data); ``epoch(step)``: passes over the data so far;
    ``checkpoint_record(step)``: what a checkpoint of `step` stores of the loader (a
    collective on several processes); ``resume(record, step)``: continue from such a record;
    ``metrics()``: the loader's fields of a metrics record (a collective on several
    processes); ``close()``: release workers and files.
    """

    def batch(self, step: int) -> np.ndarray: ...

    def epoch(self, step: int) -> float: ...

    def checkpoint_record(self, step: int) -> dict[str, Any]: ...

    def resume(self, record: Mapping[str, Any], step: int) -> None: ...

    def metrics(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class TrainLoader:
    """Deterministic shuffled batches; the only state is the step (a `BatchLoader`).

    Step s uses global sample numbers [s*B, (s+1)*B); sample g is sequence
    ``perm_{g // n}[g % n]`` (a fresh permutation per epoch). A process of a
    multi-host run takes its contiguous slice of rows.
    """

    def __init__(self, seqs: Sequences, *, global_batch: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if len(seqs) == 0:
            raise DataError(f"the training split has fewer than seq_len+1 = {seqs.seq_len + 1} "
                            "tokens")
        if global_batch % process_count:
            raise ConfigError(f"train.global_batch ({global_batch}) must be divisible by the "
                              f"number of processes ({process_count})")
        self.seqs, self.global_batch, self.seed = seqs, global_batch, seed
        self.local = global_batch // process_count
        self.offset = process_index * self.local
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(len(self.seqs), self.seed, epoch))
        return self._perm[1]

    def indices(self, step: int) -> np.ndarray:
        """Sequence indices (int64[local batch]) this process reads at `step`."""
        n = len(self.seqs)
        g = step * self.global_batch + self.offset + np.arange(self.local, dtype=np.int64)
        out = np.empty_like(g)
        for epoch in np.unique(g // n):
            sel = (g // n) == epoch
            out[sel] = self._permutation(int(epoch))[g[sel] % n]
        return out

    def batch(self, step: int) -> np.ndarray:
        """int32[local batch, seq_len + 1] for `step`."""
        return self.seqs.take(self.indices(step))

    def epoch(self, step: int) -> float:
        return step * self.global_batch / len(self.seqs)

    def checkpoint_record(self, step: int) -> dict[str, Any]:
        """Nothing: the step is the position."""
        return {}

    def resume(self, record: Mapping[str, Any], step: int) -> None:
        """Nothing to restore: `batch` takes any step."""

    def metrics(self) -> dict[str, Any]:
        """No loader fields in the metrics."""
        return {}

    def close(self) -> None:
        """Nothing to release (the streaming loader's workers are; one interface)."""


def eval_batches(seqs: Sequences, n_sequences: int, batch: int) -> list[np.ndarray]:
    """The fixed validation set: first `n_sequences` sequences, in `batch`-sized chunks."""
    if n_sequences > len(seqs):
        raise ConfigError(f"train.eval_sequences={n_sequences} but the validation split has only "
                          f"{len(seqs)} sequences of {seqs.seq_len + 1} tokens")
    if n_sequences % batch:
        raise ConfigError(f"train.eval_sequences ({n_sequences}) must be a multiple of the eval "
                          f"batch ({batch})")
    return [seqs.take(np.arange(i, i + batch)) for i in range(0, n_sequences, batch)]

