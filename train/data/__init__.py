"""The data pipeline: read documents, tokenize once into uint32 memmaps, pack, shuffle, load.

Preparation (`prepare`) turns the `data` section of a config into a cached
directory ``<cache_dir>/<name>-<tokenizer>-<fingerprint>/`` holding

* ``train.bin`` / ``val.bin``: uint32 token streams, every document followed by
  EOS (and preceded by BOS when ``add_bos``), documents concatenated in order;
* ``tokenizer.json``: the tokenizer used (the trained BPE, or a copy of the HF file);
* ``meta.json``: counts, ids, the fingerprint of sources and settings.

The fingerprint covers the source files (name, size and a SHA-256 of the whole
content, streamed in 1 MiB chunks), the tokenizer spec and the split
settings, so a changed input gets a new directory and a cached one is never
stale. Before a BPE tokenizer is trained, every source is read once to check it
(gzip, UTF-8, JSON): a bad file is reported with its name and line before any
training. Directories are written to a temporary name and
renamed, so a killed preparation leaves nothing half-written.

Packing is Megatron-style: the stream is cut into sequences of ``seq_len + 1``
tokens overlapping by one (inputs ``s[:-1]``, targets ``s[1:]``), with no masking
at document boundaries. Training order is a per-epoch permutation derived from
the seed (a splitmix64 hash, independent of the NumPy version); the loader's only
state is the step, so a resumed run reads exactly the batches it would have.

Validation: ``val_sources`` when given (e.g. the C4 validation shard), else every
``holdout_every``-th block of ``holdout_block`` documents of ``sources`` is held out.
Evaluation uses the first ``eval_sequences`` packed validation sequences, in order.

CLI: ``python -m train.data prepare --config configs/tiny.yaml`` (or flags, see
``--help``); ``python -m train.data info DIR``.

Modules: ``sources`` (finding and reading source files: ``embedded:`` corpora,
globs, text/JSONL readers, the train/validation split, file digests),
``tokenizer`` (the byte-level BPE trainer and the HF tokenizer wrapper),
``cache`` (the prepared directory: fingerprint, ``prepare``, ``open_prepared``),
``loader`` (packing, the deterministic shuffle, train and eval batches),
``records`` (a shard's documents and bad records, for the stream), ``grain_pipeline``
(the grain datasets: shard order, chunks, tokenize, pack), ``stream`` (``data.loader:
grain``: shards streamed, tokenized in grain worker processes, packed on the fly,
resumable; docs/DATA.md), ``run_data`` (a run's data, prepared or streamed, behind one
interface: its loader is a ``loader.BatchLoader``), ``__main__`` (the CLI).
The names below are re-exported so ``from train import data; data.prepare(...)`` works.
"""

from train.data.cache import (
    FORMAT_VERSION,
    PreparedData,
    check_documents,
    fingerprint,
    open_prepared,
    prepare,
    prepared_dir,
)
from train.data.loader import Sequences, TrainLoader, epoch_permutation, eval_batches
from train.data.sources import (
    EMBEDDED,
    HASH_CHUNK,
    DataError,
    check_files,
    detect_format,
    file_digest,
    iter_documents,
    iter_split,
    resolve_sources,
)

__all__ = [
    "EMBEDDED",
    "FORMAT_VERSION",
    "HASH_CHUNK",
    "DataError",
    "PreparedData",
    "Sequences",
    "TrainLoader",
    "check_documents",
    "check_files",
    "detect_format",
    "epoch_permutation",
    "eval_batches",
    "file_digest",
    "fingerprint",
    "iter_documents",
    "iter_split",
    "open_prepared",
    "prepare",
    "prepared_dir",
    "resolve_sources",
]
