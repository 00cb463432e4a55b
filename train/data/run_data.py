"""A run's data as one process reads it: the training batches' loader and the validation
sequences, whichever ``data.loader`` provides them (`run_data` chooses, once).

`PreparedRunData` (the prepared cache: a `train.data.loader.TrainLoader` of random access by
step) and `StreamRunData` (the grain stream: a `train.data.stream.StreamLoader` of
consecutive steps with a resumable state) answer the same questions, so the run
(`train.run.CompiledRun`) and the trainer never ask which one they have.
"""

from __future__ import annotations

import dataclasses

from train.config import DataSection
from train.data.cache import PreparedData
from train.data.loader import Sequences, TrainLoader
from train.data.stream import StreamData, StreamLoader, spec_for_process


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedRunData:
    """The prepared cache's training and validation sequences (token ids checked on read)."""

    train: Sequences
    val: Sequences
    global_batch: int
    process_index: int = 0
    process_count: int = 1

    def loader(self, seed: int) -> TrainLoader:
        """The batches of `seed`'s shuffle (random access by step)."""
        return TrainLoader(self.train, global_batch=self.global_batch, seed=seed,
                           process_index=self.process_index, process_count=self.process_count)

    @property
    def train_samples(self) -> int:
        """Training sequences."""
        return len(self.train)

    def summary(self) -> str:
        """One line on the training data, for the run's log."""
        return f"{len(self.train)} train sequences of {self.train.seq_len} tokens"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamRunData:
    """The grain stream's settings (its loader opens the shards) and validation sequences."""

    data: DataSection
    val: Sequences
    n_sources: int
    vocab_size: int
    global_batch: int
    process_index: int = 0
    process_count: int = 1
    train: None = None  # nothing tokenized before the first batch

    def loader(self, seed: int) -> StreamLoader:
        """This process's stream of `seed` (consecutive steps; resumable state)."""
        spec = spec_for_process(self.data, seed, self.process_index, self.process_count)
        return StreamLoader(spec, global_batch=self.global_batch,
                            process_count=self.process_count, process_index=self.process_index,
                            vocab_size=self.vocab_size)

    @property
    def train_samples(self) -> None:
        """Not counted: a stream is read as it goes."""
        return None

    def summary(self) -> str:
        """One line on the training data, for the run's log."""
        n, w = self.n_sources, self.data.workers
        return (f"{n} shard{'s' * (n != 1)} streamed (grain, {w} worker{'s' * (w != 1)} per "
                f"process) into sequences of {self.data.seq_len} tokens")


def run_data(data: DataSection, *, prepared: PreparedData | None, stream: StreamData | None,
             vocab_size: int, global_batch: int, process_index: int = 0,
             process_count: int = 1) -> PreparedRunData | StreamRunData:
    """The run's data from what validating its config found (`train.plan.Plan`'s
    ``prepared`` or ``stream``); token ids at or above `vocab_size` are refused on read."""
    T = data.seq_len
    if stream is None:
        return PreparedRunData(
            train=Sequences(prepared.tokens("train"), T, vocab_size=vocab_size,
                            source=prepared.path / "train.bin"),
            val=Sequences(prepared.tokens("val"), T, vocab_size=vocab_size,
                          source=prepared.path / "val.bin"),
            global_batch=global_batch, process_index=process_index,
            process_count=process_count)
    return StreamRunData(
        data=data, val=Sequences(stream.val_tokens, T, vocab_size=vocab_size,
                                 source=", ".join(data.val_sources)),
        n_sources=stream.n_sources, vocab_size=vocab_size, global_batch=global_batch,
        process_index=process_index, process_count=process_count)
