"""The train section: tokens/s of a ~1B Llama train step (AdamW) under bf16 and
mxfp4_all_h16 (emulation, and the kernels of the 'auto' backend)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bench.device.harness import SKIPPED, Pace, Sizes, Table, log, short_error, timeit


def train_section(table: Table, sz: Sizes, deadline: float) -> None:
    import optax
    from flax import nnx

    from models.llama import Llama, LlamaConfig
    from mxjax import policies
    from mxjax.backends import resolve_backend

    rows = table.section("~1B Llama train step (AdamW), tokens/s",
                         ("policy", "backend", "tokens/s", "vs bf16", "step time vs bf16"))
    pace = Pace(deadline)
    batch, seq, layers = sz.train
    if sz.tiny_model:
        cfg = LlamaConfig.tiny(n_layers=layers, max_seq_len=seq)
    else:
        cfg = LlamaConfig.llama3_1b(n_layers=layers, max_seq_len=seq, dtype="bfloat16",
                                    param_dtype="float32")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-4)
    tokens = jax.random.randint(jax.random.key(3), (batch, seq + 1), 0, cfg.vocab_size)

    def make_step(policy):
        def loss_fn(p, key):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1], policy=policy, policy_key=key)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens[:, 1:]).mean()

        @jax.jit
        def step(p, s, key):
            loss, g = jax.value_and_grad(loss_fn)(p, key)
            upd, s = opt.update(g, s, p)
            return optax.apply_updates(p, upd), s, loss

        return step

    h16 = policies.get("mxfp4_all_h16")
    kernel_backend = resolve_backend("auto")
    configs = [("bf16", None, "-"), ("mxfp4_all_h16", h16, "xla")]
    try:
        configs.append(("mxfp4_all_h16", h16.with_backend(kernel_backend), kernel_backend))
    except Exception as e:  # noqa: BLE001 - reported in the table
        rows.append(("mxfp4_all_h16", kernel_backend, short_error(e), ""))
    base = None
    key = jax.random.key(4)
    for name, policy, be in configs:
        if not pace.ok():
            rows.append((name, be, SKIPPED, ""))
            continue
        t0 = time.perf_counter()
        try:
            step = make_step(policy)
            state = (params, opt.init(params))

            def run(st, step=step):
                p, s, _ = step(st[0], st[1], key)
                return (p, s)

            t = timeit(run, state, iters=5, warmup=2)
            del state
            tps = batch * seq / t
            base = tps if name == "bf16" else base
            rows.append((name, be, f"{tps:10.0f}", f"{tps / base:5.2f}x" if base else "",
                         f"{base / tps:5.2f}x" if base else ""))
            log(f"train {name} [{be}]: {tps:.0f} tokens/s")
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append((name, be, short_error(e), ""))
        pace.took(time.perf_counter() - t0)
    name = "tiny" if sz.tiny_model else "llama3_1b"
    rows.append(f"config: {layers} layers of {name}, batch {batch} x seq {seq}")
    del params, model
