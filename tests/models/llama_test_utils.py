"""Small test-only policies for tests/models (duck-typed precision policies)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig


@dataclasses.dataclass(frozen=True, eq=False)
class RecordingPolicy:
    """Plain lax.dot_general that reports each GEMM's key (via jax.debug.callback).

    Hashed by identity (a static jit argument: a new instance retraces).
    ``sink`` is a list shared with the test; each call appends the uint32 key
    data it was given. Noise (``noise > 0``) adds key-dependent output noise so
    tests can see that different keys give different results.
    """

    sink: list = dataclasses.field(default_factory=list)
    needs_key: bool = True
    noise: float = 0.0
    name: str = "recording"

    def dot_general(self, key=None):
        sink = self.sink
        noise = self.noise

        def dg(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               **kwargs):
            out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                      preferred_element_type=preferred_element_type)
            if key is not None:
                jax.debug.callback(lambda k: sink.append(tuple(np.asarray(k).tolist())),
                                   jax.random.key_data(key))
                if noise:
                    out = out + (noise * jax.random.normal(key, out.shape)).astype(out.dtype)
            else:
                jax.debug.callback(lambda: sink.append(None))
            return out

        return dg


def key_tuple(key) -> tuple:
    return tuple(np.asarray(jax.random.key_data(key)).tolist())


def expected_layer_keys(policy_key, n_layers: int, projections) -> set[tuple]:
    return {key_tuple(jax.random.fold_in(jax.random.fold_in(policy_key, layer), p))
            for layer in range(n_layers) for p in projections}


def max_abs(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def small(**kw) -> LlamaConfig:
    """A cheap config of tiny's kind (GQA 4/2 heads, 2 layers, vocab 128)."""
    base = {"vocab_size": 128, "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
            "ffn_dim": 160}
    base.update(kw)
    return LlamaConfig.tiny(**base)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_on_8_fake_devices(script: str) -> dict:
    """Runs `script` in a fresh CPU process with 8 fake devices (XLA_FLAGS must be set
    before jax starts); returns the JSON after its last ``RESULT`` line."""
    # the session's compile-speed flag (tests/conftest.py), if set, plus 8 devices
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith("--xla_backend_optimization_level=")]
    env = dict(os.environ,
               XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=8"]),
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
