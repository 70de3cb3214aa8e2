import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxtune.config import OptimizerConfig
from mlxtune.optim import AdamWMatrices, build_optimizer, make_schedule


def test_weight_decay_touches_matrices_only():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    before = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    opt = AdamWMatrices(learning_rate=0.1, weight_decay=0.5)
    zeros = nn.utils.tree_map(mx.zeros_like, model.parameters())
    opt.update(model, zeros)  # zero gradient: only decay can move a weight
    after = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    np.testing.assert_allclose(
        after["layers.0.weight"], before["layers.0.weight"] * (1 - 0.1 * 0.5), rtol=1e-6
    )
    for k in ("layers.0.bias", "layers.1.weight", "layers.1.bias"):
        np.testing.assert_array_equal(after[k], before[k])


def test_adamw_matches_the_textbook_update_with_bias_correction():
    p = mx.array([[1.0, -2.0], [0.5, 3.0]])
    g = mx.array([[0.1, -0.2], [0.3, 0.05]])
    opt = build_optimizer(
        OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1), lambda step: mx.array(0.01)
    )
    params = {"w": p}
    opt.init(params)
    new = opt.apply_gradients({"w": g}, params)["w"]
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-8, 0.01, 0.1
    m = (1 - b1) * np.array(g)
    v = (1 - b2) * np.array(g) ** 2
    expected = np.array(p) * (1 - lr * wd) - lr * (m / (1 - b1)) / (np.sqrt(v / (1 - b2)) + eps)
    np.testing.assert_allclose(np.array(new), expected, rtol=1e-5)


# total 100 steps, warmup 10: the decay runs from step 10 to step 99 (the last), t = (step - 10) / 89
@pytest.mark.parametrize(
    "name, step, expected",
    [
        ("constant", 10, 1.0),
        ("constant", 99, 1.0),
        ("linear", 10, 1.0),
        ("linear", 55, 1.0 + (0.1 - 1.0) * 45 / 89),
        ("linear", 99, 0.1),
        ("cosine", 10, 1.0),
        ("cosine", 55, 0.1 + 0.45 * (1 + math.cos(math.pi * 45 / 89))),
        ("cosine", 99, 0.1),
    ],
)
def test_schedules_after_warmup(name, step, expected):
    s = make_schedule(name, lr=1.0, total_steps=100, warmup_steps=10, min_lr=0.1)
    assert float(s(step)) == pytest.approx(expected, rel=1e-5)


def test_warmup_rises_linearly_from_zero():
    s = make_schedule("cosine", lr=1.0, total_steps=100, warmup_steps=10, min_lr=0.0)
    vals = [float(s(i)) for i in range(10)]
    assert vals == pytest.approx([(i + 1) / 10 for i in range(10)])


def test_warmup_cosine_defaults_to_five_percent_warmup():
    s = make_schedule("warmup_cosine", lr=1.0, total_steps=200, warmup_steps=None, min_lr=0.0)
    assert float(s(0)) == pytest.approx(0.1)
    assert float(s(9)) == pytest.approx(1.0)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(199)) == pytest.approx(0.0, abs=1e-7)  # the last step runs at min_lr


def test_sgd_decay_touches_matrices_only():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    before = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    opt = build_optimizer(OptimizerConfig(name="sgd", lr=0.1, momentum=0.0, weight_decay=0.5), 0.1)
    opt.update(model, nn.utils.tree_map(mx.zeros_like, model.parameters()))
    after = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    np.testing.assert_allclose(
        after["layers.0.weight"], before["layers.0.weight"] * (1 - 0.1 * 0.5), rtol=1e-6
    )
    for k in ("layers.0.bias", "layers.1.weight", "layers.1.bias"):
        np.testing.assert_array_equal(after[k], before[k])


def sgd_reference(weights, grads, lrs, momentum, decay, decoupled=True):
    """Naive float64 SGD with momentum (v <- momentum * v + g, velocity from zero) over several
    steps; matrices decay by lr * decay a step (decoupled), or through the gradient (L2)."""
    w = {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    for g, lr in zip(grads, lrs, strict=True):
        for k in w:
            d = decay if w[k].ndim >= 2 else 0.0
            gk = np.array(g[k], dtype=np.float64) + (0.0 if decoupled else d * w[k])
            v[k] = momentum * v[k] + gk
            w[k] = w[k] * (1 - lr * d if decoupled else 1.0) - lr * v[k]
    return w


def test_sgd_with_momentum_decays_decoupled_over_several_steps():
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5))
    mx.eval(model.parameters())
    before = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    lrs = [0.05, 0.1, 0.08, 0.03, 0.06, 0.02]  # a schedule of its own: the step's lr is used
    grads = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in before.items()} for _ in lrs
    ]
    cfg = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.5)
    opt = build_optimizer(cfg, lambda step: mx.array(lrs)[step])
    for g in grads:
        opt.update(model, nn.utils.tree_unflatten([(k, mx.array(x)) for k, x in g.items()]))
        mx.eval(model.parameters())
    after = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    want = sgd_reference(before, grads, lrs, 0.9, 0.5)
    for k in before:
        np.testing.assert_allclose(after[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # the test tells decoupled decay from L2 through the gradient: they end far apart
    l2 = sgd_reference(before, grads, lrs, 0.9, 0.5, decoupled=False)
    assert np.abs(l2["layers.0.weight"] - want["layers.0.weight"]).max() > 1e-2
