"""A run's plan: the config resolved and validated before anything compiles.

`validate(config) -> Plan` checks the data files, the policy, the model
overrides, the mesh and the batch sizes, prepares (or reuses) the tokenized
data, and returns everything the trainer needs that does not need compilation.
Every problem is a `ConfigError` naming the config key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from models.llama import LlamaConfig, RopeScaling
from mxjax import PrecisionPolicy, policies
from mxjax.backends import Capabilities
from mxjax.shard_blocks import linear_shard_problems
from train import backend as gemm_backend
from train import data as datamod
from train.config import Config, ConfigError
from train.data import stream as stream_data
from train.data.tokenizer import TokenizerError, load_hf
from train.jsonsafe import jsonable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated run: everything resolved that does not need compilation.

    mesh_axes: (data, fsdp, tensor) sizes; eval_batch: sequences per eval step;
    policy_record: the policy as a JSON dict (None without a policy), which a
    checkpoint must match to be resumed.
    """

    config: Config
    model_config: LlamaConfig
    policy: PrecisionPolicy | None
    policy_name: str
    policy_record: dict[str, Any] | None
    mesh_axes: tuple[int, int, int]
    prepared: datamod.PreparedData | None
    eval_batch: int
    stream: stream_data.StreamData | None = None  # data.loader grain (then prepared is None)


def resolve_policy(
        spec: str | Mapping[str, Any] | None, backend: str | None = None, *,
        caps: Capabilities | None = None,
) -> tuple[PrecisionPolicy | None, str, dict[str, Any] | None]:
    """(policy or None, display name, JSON record) for a config's ``policy`` entry
    (looked up by `mxjax.policies.resolve`; its errors become ConfigErrors), its
    quantized GEMMs on `backend` when one is given (`with_backend`; the config's
    ``backend``), their backends checked on the chip compiled for or the chip of ``caps``
    (`check_backends`)."""
    try:
        pol = policies.resolve(spec)
    except (ValueError, TypeError, KeyError) as e:
        if isinstance(spec, str):
            raise ConfigError(str(e)) from None
        raise ConfigError(f"policy: invalid policy dict ({type(e).__name__}: {e})") from None
    if pol is None:
        return None, "none", None
    name = spec if isinstance(spec, str) else (pol.name or str(spec.get("name") or "custom"))
    if backend is not None:
        pol = gemm_backend.apply_backend(pol, backend, gemm_backend.stated_backends(spec))
        if backend != "auto":
            name = f"{name.split('@', 1)[0]}@{backend}"
    check_backends(pol, caps=caps)
    return pol, name, jsonable(policies.to_dict(pol))


def with_backend(policy: PrecisionPolicy | None, backend: str | None) -> PrecisionPolicy | None:
    """`policy` under the config's ``backend`` (`train.backend.apply_backend`; None:
    unchanged; a ConfigError names a bad one), applied to every policy a run compiles.
    'auto' keeps the backends of a policy named ``<name>@<backend>`` (`PrecisionPolicy.
    with_backend`'s name: they were asked for), as `resolve_policy` keeps a config's."""
    stated = gemm_backend.stated_backends(policy.name) if policy and policy.name else frozenset()
    return gemm_backend.apply_backend(policy, backend, stated)


def check_backends(policy: PrecisionPolicy, *, caps: Capabilities | None = None) -> None:
    """Every quantized GEMM's backend can run on this device (or the chip of ``caps``,
    ``--check --chip``) and implements its formats (`PrecisionPolicy.check_backends`), and
    gives a speed-up there (`train.backend.check_speedup`), as a ConfigError naming the GEMM.

    The interceptor raises the same errors at trace time; checked here so that
    ``--check`` reports them before anything compiles.
    """
    try:
        policy.check_backends(caps=caps)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    gemm_backend.check_speedup(policy, caps=caps)


def build_model_config(config: Config, vocab_size: int,
                       max_token_id: int | None = None) -> LlamaConfig:
    """LlamaConfig from ``model.preset`` + overrides, fp32 params, configured compute dtype.

    ``vocab_size`` (the tokenizer's) is the model's vocabulary for the ``tiny``
    preset unless overridden; the Llama presets keep theirs (128256). The data's
    largest token id, when given, must fit the model's vocabulary.
    """
    ms = config.model
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    over = dict(ms.overrides)
    bad = sorted(set(over) - fields)
    if bad:
        raise ConfigError(f"model.overrides: unknown LlamaConfig field(s) {', '.join(bad)}; "
                          f"valid: {', '.join(sorted(fields))}")
    for k in ("dtype", "param_dtype"):
        if k in over:
            raise ConfigError(f"model.overrides.{k}: not settable here (master weights are fp32;"
                              " use model.compute_dtype for the compute dtype)")
    if isinstance(over.get("rope_scaling"), Mapping):
        try:
            over["rope_scaling"] = RopeScaling(**over["rope_scaling"])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.overrides.rope_scaling: {e}") from None
    if ms.preset == "tiny":  # the small model takes the tokenizer's size; Llama presets keep theirs
        over.setdefault("vocab_size", vocab_size)
    try:
        mc = getattr(LlamaConfig, ms.preset)(**over, dtype=ms.compute_dtype,
                                               param_dtype="float32")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    if max_token_id is not None and max_token_id >= mc.vocab_size:
        raise ConfigError(f"model vocab_size={mc.vocab_size} is too small for the data: token id "
                          f"{max_token_id} occurs in the prepared data (tokenizer vocabulary "
                          f"{vocab_size}); set model.overrides.vocab_size={max_token_id + 1} or "
                          "more")
    if config.data.seq_len > mc.max_seq_len:
        raise ConfigError(f"data.seq_len={config.data.seq_len} is longer than the model supports "
                          f"(max_seq_len={mc.max_seq_len}; raise model.overrides.max_seq_len)")
    return mc


def resolve_mesh(config: Config, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes; a -1 axis takes the devices the others leave."""
    m = config.mesh
    sizes = [m.data, m.fsdp, m.tensor]
    if -1 in sizes:
        i = sizes.index(-1)
        sizes[i] = 1
        sizes[i] = max(1, n_devices // math.prod(sizes))
    data, fsdp, tensor = sizes
    total = data * fsdp * tensor
    if total > n_devices:
        raise ConfigError(f"mesh: data*fsdp*tensor = {data}*{fsdp}*{tensor} = {total} "
                          f"devices, only {n_devices} available (python -m train --check "
                          "--devices N --chip NAME plans for hardware this host lacks)")
    micro = config.train.micro_batch or config.train.global_batch
    if micro % (data * fsdp):
        raise ConfigError(f"train.micro_batch (or global_batch) = {micro} must be divisible by "
                          f"mesh data*fsdp = {data * fsdp}")
    return data, fsdp, tensor


def check_mesh_blocks(policy: PrecisionPolicy | None, config: Config,
                      model_config: LlamaConfig, mesh_axes: tuple[int, int, int], *,
                      policy_name: str | None = None) -> None:
    """Refuse (ConfigError) a mesh whose shards would cut `policy`'s quantization blocks.

    Every Linear kernel ``[..., d_in, d_out]`` the policy reaches (the decoder layers'; under
    ``quantize_embed_head`` the embedding table ``[V, D]`` and the head's, or the tied
    table's ``[D, V]`` view), sharded by the model's rules (`models.sharding`), must hold
    whole blocks per device along ``d_in`` (fprop's contraction) and ``d_out`` (dgrad's),
    and a device's tokens (``micro_batch / (data * fsdp) * seq_len``) along wgrad's
    (`mxjax.shard_blocks.linear_shard_problems`). Each device then quantizes its own shard
    and the weights are gathered packed; otherwise an operand would be gathered in bf16
    before quantizing.
    """
    if policy is None or math.prod(mesh_axes) == 1:
        return
    from flax import nnx
    from jax.sharding import AbstractMesh

    from models import sharding as shd
    from models.llama import Llama

    mesh = AbstractMesh(tuple(mesh_axes), shd.MESH_AXES)
    abstract = nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0)))
    specs = shd.param_partition_specs(abstract, mesh)
    shapes = {p: v.shape for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    quantized_ends = model_config.quantize_embed_head
    kernels = {}
    for path, spec in specs.items():
        name, shape = ".".join(map(str, path)), shapes[path]
        if path[-1] == "kernel" and (path[0] != "lm_head" or quantized_ends):
            kernels[name] = (shape, spec)
        elif path[-1] == "embedding" and quantized_ends:
            kernels[name] = (shape, spec)  # the one-hot GEMM's [V, D]
            if model_config.tie_embeddings:  # and the head's [D, V] view of it
                entries = tuple(spec) + (None,) * (2 - len(spec))
                kernels[name + " (as the head)"] = (shape[::-1], entries[::-1])
    data, fsdp, tensor = mesh_axes
    micro = config.train.micro_batch or config.train.global_batch
    problems = linear_shard_problems(policy, kernels, dict(zip(shd.MESH_AXES, mesh_axes)),
                                     tokens_per_shard=micro // (data * fsdp)
                                     * config.data.seq_len)
    if problems:
        raise ConfigError(
            f"mesh (data={data}, fsdp={fsdp}, tensor={tensor}) under policy "
            f"{policy.name or policy_name or 'from the config'!r}: shards would cut "
            "quantization blocks, so operands would be gathered in bf16 before quantizing:"
            "\n  " + "\n  ".join(problems)
            + "\nchoose mesh sizes (or data.seq_len, train.micro_batch) that leave whole "
              "blocks on every device")


def check_out_dir(out: Path) -> None:
    """The output directory ``out`` (``out_dir``, ``--out``; a train or a study config's
    ``out_path``) is a directory or can be made one: neither it nor a parent of it is an
    existing file (ConfigError otherwise)."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is" if p == out else f"lies under {p}, which is"
                raise ConfigError(f"out_dir (--out) {out} {what} a file, not a directory; "
                                  "choose another output directory")
            return


def _nominal_vocab(config: Config) -> int:
    d = config.data
    if d.tokenizer == "bpe" or config.model.preset != "tiny":
        return d.vocab_size
    return load_hf(d.tokenizer, eos_token=d.eos_token).vocab_size


def _has_checkpoint(config: Config) -> bool:
    """Whether the run directory holds a checkpoint step (so the run resumes from it)."""
    d = config.out_path / "checkpoints"
    return d.is_dir() and any(p.is_dir() and p.name.isdigit() for p in d.iterdir())


def _check_init_from(config: Config, mc: LlamaConfig) -> None:
    """``model.init_from``'s architecture against the run's model, whatever the data loader
    (`train.hf.check_init_from`); skipped when the run resumes from a checkpoint of its own,
    which never reads the HF weights again."""
    if config.model.init_from is not None and not _has_checkpoint(config):
        from train.hf import check_init_from

        check_init_from(config.model.init_from, mc)


def nominal_model_config(config: Config) -> tuple[LlamaConfig, str | None]:
    """The model config as far as it is known without reading data: (config, a note when
    its vocabulary is assumed). The Llama presets and the trained BPE know their vocabulary;
    a ``tiny`` model on an HF tokenizer takes the tokenizer's size, or ``data.vocab_size``
    when the tokenizer cannot be read (the note says so). ConfigError for a bad model
    section."""
    try:
        return build_model_config(config, _nominal_vocab(config)), None
    except TokenizerError as e:
        note = (f"vocabulary assumed to be data.vocab_size={config.data.vocab_size}: the "
                f"tokenizer cannot be read ({e})")
        return build_model_config(config, config.data.vocab_size), note


def validate(config: Config, *, verbose: bool = True, n_devices: int | None = None,
             caps: Capabilities | None = None) -> Plan:
    """Check everything that can be checked without compiling; prepare (cached) data.

    Raises ConfigError naming the problem: missing files, unknown policy, model
    overrides, sequence longer than the model supports, mesh/batch sizes,
    too few validation sequences, a model.init_from checkpoint of another
    architecture (checked when the run starts fresh: a run with a checkpoint
    resumes from it and never reads model.init_from again). The mesh is resolved for
    `n_devices` devices (default: ``jax.device_count()``; ``--check --devices N``), the
    policy's backends for the chip of ``caps`` (default: the one compiled for; ``--check
    --chip NAME``).
    """
    check_out_dir(config.out_path)
    datamod.check_files(config.data)
    policy, name, record = resolve_policy(config.policy, config.backend, caps=caps)
    try:
        build_model_config(config, _nominal_vocab(config))
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    mesh_axes = resolve_mesh(config, n_devices or jax.device_count())
    t = config.train
    micro = t.micro_batch or t.global_batch
    eval_batch = t.eval_batch or min(micro, t.eval_sequences)
    if eval_batch % (mesh_axes[0] * mesh_axes[1]):
        raise ConfigError(f"train.eval_batch={eval_batch} must be divisible by mesh data*fsdp = "
                          f"{mesh_axes[0] * mesh_axes[1]}")
    if config.data.loader == "grain":
        return _validate_stream(config, policy, name, record, mesh_axes, eval_batch)
    try:
        prepared = datamod.prepare(config.data, verbose=verbose)
    except datamod.DataError as e:
        raise ConfigError(f"data: {e}") from None
    mc = build_model_config(config, prepared.vocab_size, int(prepared.meta["max_token_id"]))
    _check_init_from(config, mc)
    check_mesh_blocks(policy, config, mc, mesh_axes, policy_name=name)
    val = datamod.Sequences(prepared.tokens("val"), config.data.seq_len)
    if t.eval_sequences > len(val):
        raise ConfigError(f"train.eval_sequences={t.eval_sequences} but the validation split has "
                          f"only {len(val)} sequences of {config.data.seq_len + 1} tokens")
    if t.eval_sequences % eval_batch:
        raise ConfigError(f"train.eval_sequences ({t.eval_sequences}) must be a multiple of the "
                          f"eval batch ({eval_batch})")
    if datamod.Sequences(prepared.tokens("train"), config.data.seq_len).n == 0:
        raise ConfigError("data: the training split is shorter than one sequence")
    return Plan(config=config, model_config=mc, policy=policy, policy_name=name,
                policy_record=record, mesh_axes=mesh_axes, prepared=prepared,
                eval_batch=eval_batch)


def _validate_stream(config: Config, policy: PrecisionPolicy | None, name: str,
                     record: dict[str, Any] | None, mesh_axes: tuple[int, int, int],
                     eval_batch: int) -> Plan:
    """`validate`'s data.loader grain branch: no document of the training shards is read."""
    d, t = config.data, config.train
    files = stream_data.check_stream(d)
    mine = stream_data.host_shards(files, jax.process_index(), jax.process_count())
    stream_data.probe_shards(mine, stream_data.RecordReader(text_key=d.text_key,
                                                             on_bad_record=d.on_bad_record))
    tok = load_hf(d.tokenizer, eos_token=d.eos_token, add_bos=d.add_bos)
    mc = build_model_config(config, tok.vocab_size)
    if tok.vocab_size > mc.vocab_size:  # every id the tokenizer can produce must fit the model
        raise ConfigError(f"data.tokenizer {d.tokenizer} has {tok.vocab_size} token ids (0 to "
                          f"{tok.vocab_size - 1}), more than the model's vocab_size="
                          f"{mc.vocab_size}: use a tokenizer of at most {mc.vocab_size} ids, "
                          f"or set model.overrides.vocab_size={tok.vocab_size}")
    _check_init_from(config, mc)
    check_mesh_blocks(policy, config, mc, mesh_axes, policy_name=name)
    try:
        val_tokens = stream_data.validation_tokens(d, t.eval_sequences, tokenizer=tok)
    except datamod.DataError as e:
        raise ConfigError(f"data.val_sources: {e}") from None
    val = datamod.Sequences(val_tokens, d.seq_len)
    if t.eval_sequences > len(val):
        raise ConfigError(f"train.eval_sequences={t.eval_sequences} but data.val_sources hold "
                          f"only {len(val)} sequences of {d.seq_len + 1} tokens")
    if t.eval_sequences % eval_batch:
        raise ConfigError(f"train.eval_sequences ({t.eval_sequences}) must be a multiple of the "
                          f"eval batch ({eval_batch})")
    return Plan(config=config, model_config=mc, policy=policy, policy_name=name,
                policy_record=record, mesh_axes=mesh_axes, prepared=None, eval_batch=eval_batch,
                stream=stream_data.StreamData(vocab_size=tok.vocab_size, n_sources=len(files),
                                              val_tokens=val_tokens))


def data_facts(plan: Plan) -> dict[str, Any]:
    """The data part of ``--check``'s report."""
    if plan.stream is None:
        p = plan.prepared
        return {"vocab_size": p.vocab_size, "prepared_data": str(p.path),
                "train_tokens": p.meta["train_tokens"], "val_tokens": p.meta["val_tokens"]}
    return {"vocab_size": plan.stream.vocab_size, "loader": "grain",
            "train_shards": plan.stream.n_sources,
            "workers_per_process": plan.config.data.workers,
            "val_tokens": int(plan.stream.val_tokens.size)}
