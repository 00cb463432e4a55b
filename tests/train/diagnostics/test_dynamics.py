"""train.diagnostics.dynamics: per-layer norms, collapse rate, update size, the instability
detector."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.diagnostics import dynamics as TD


def test_layer_norms_collapse_and_update():
    tree = {"layers": {"w": jnp.asarray([[3.0, 4.0], [0.0, 1e-8]])}, "head": jnp.asarray([1.0])}
    n = TD.layer_norms(tree)
    np.testing.assert_allclose(np.asarray(n["layers.w"]), [5.0, 1e-8], rtol=1e-6)
    flat = TD.expand_layers(n)
    assert set(flat) == {"layers.0.w", "layers.1.w", "head"}
    assert TD.collapse_rate(n) == pytest.approx(1 / 3)
    assert TD.collapse_rate([1.0, 1e-7, float("nan")]) == pytest.approx(1 / 3)
    new = jax.tree.map(lambda a: a * 1.1, tree)
    r = TD.relative_update(tree, new)
    np.testing.assert_allclose(np.asarray(r["layers.w"]), [0.1, 0.1], rtol=1e-4)
    assert float(r["head"]) == pytest.approx(0.1, rel=1e-5)
    with pytest.raises(ValueError, match="norms: no layers"):
        TD.collapse_rate([])


def test_instability_growth():
    det = TD.InstabilityDetector()
    # running min 0.5 from step 1; steps 3..7 exceed 100 * 0.5 = 50 -> event at step 3
    s = det.run([1.0, 0.5, 0.6, 60, 70, 80, 90, 100, 1.0])
    assert (s.event_step, s.event_kind) == (3, "grad_norm_growth")
    # interrupted runs of 4 never fire
    s = det.run([1.0, 0.5, 60, 70, 80, 90, 0.6, 60, 70, 80, 90])
    assert s.event_step is None
    # 50 is not > 100 * 0.5
    assert det.run([0.5, 50, 50, 50, 50, 50]).event_step is None
    # non-finite norms count as growth
    assert det.run([1.0, float("nan"), float("inf"), 200, 300, 400]).event_step == 1


def test_instability_zero_gradient_and_config():
    det = TD.InstabilityDetector()
    s = det.run([1.0, 1.0] + [0.0] * 9 + [1.0] + [0.0] * 10, steps=range(100, 122))
    assert (s.event_step, s.event_kind) == (112, "zero_gradient")
    assert s.running_min == 1.0  # zeros never become the baseline
    custom = TD.InstabilityDetector(TD.InstabilityConfig(growth=10.0, growth_steps=2))
    assert custom.run([1.0, 11.0, 12.0]).event_step == 1
    with pytest.raises(ValueError, match="growth_steps"):
        TD.InstabilityConfig(growth_steps=0)
