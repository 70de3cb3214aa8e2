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


# ------------------------------------------------------------------ lion, adafactor, wsd
def run_steps(cfg, before, grads, lrs, explicit=frozenset()):
    """The optimizer of ``cfg`` over ``grads`` (a step's lr from ``lrs``) on a small model."""
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5))
    model.update(nn.utils.tree_unflatten([(k, mx.array(v)) for k, v in before.items()]))
    opt = build_optimizer(cfg, lambda step: mx.array(lrs)[step], explicit)
    for g in grads:
        opt.update(model, nn.utils.tree_unflatten([(k, mx.array(x)) for k, x in g.items()]))
        mx.eval(model.parameters())
    return {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}, opt


def problem(seed=0, steps=6):
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5))
    before = {
        k: rng.normal(size=v.shape).astype(np.float32)
        for k, v in nn.utils.tree_flatten(model.parameters())
    }
    grads = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in before.items()}
        for _ in range(steps)
    ]
    lrs = [0.05, 0.1, 0.08, 0.03, 0.06, 0.02][:steps]
    return before, grads, lrs


def lion_reference(weights, grads, lrs, b1, b2, decay):
    """Lion in float64 (Chen et al.): c = b1 m + (1 - b1) g, w <- w (1 - lr wd) - lr sign(c),
    m <- b2 m + (1 - b2) g, the decay on matrices only."""
    w = {k: np.array(v, np.float64) for k, v in weights.items()}
    m = {k: np.zeros_like(x) for k, x in w.items()}
    for g, lr in zip(grads, lrs, strict=True):
        for k in w:
            gk = np.array(g[k], np.float64)
            c = b1 * m[k] + (1 - b1) * gk
            d = decay if w[k].ndim >= 2 else 0.0
            w[k] = w[k] * (1 - lr * d) - lr * np.sign(c)
            m[k] = b2 * m[k] + (1 - b2) * gk
    return w


@pytest.mark.parametrize("betas", [None, [0.8, 0.95]], ids=["lion-defaults", "set-betas"])
def test_lion_matches_its_formula_over_several_steps(betas):
    before, grads, lrs = problem(1)
    cfg = OptimizerConfig(name="lion", lr=0.1, weight_decay=0.3)
    explicit = frozenset()
    if betas is not None:
        cfg.betas, explicit = betas, frozenset({"optimizer.betas"})
    got, _ = run_steps(cfg, before, grads, lrs, explicit)
    b1, b2 = betas or (0.9, 0.99)  # Lion's own defaults when the recipe sets none
    want = lion_reference(before, grads, lrs, b1, b2, 0.3)
    for k in before:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def adafactor_reference(weights, grads, lrs, eps1, eps2, clip, decay_rate, beta1, decay, scale):
    """Adafactor in float64 (Shazeer & Stern, Algorithm 4 with the first moment optional), at
    the given learning rates: a matrix keeps row and column means of g^2 + eps1 (decay
    beta2_t = 1 - t^decay_rate), its update is g / sqrt(R C / mean(R)), clipped to RMS ``clip``,
    times lr x max(eps2, RMS(w)); decoupled decay lr x wd on matrices."""
    w = {k: np.array(v, np.float64) for k, v in weights.items()}
    row = {k: np.zeros(x.shape[:-1]) for k, x in w.items() if x.ndim >= 2}
    col = {k: np.zeros(x.shape[:-2] + x.shape[-1:]) for k, x in w.items() if x.ndim >= 2}
    vec = {k: np.zeros_like(x) for k, x in w.items() if x.ndim < 2}
    m = {k: np.zeros_like(x) for k, x in w.items()}
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        b2 = 1 - t**decay_rate
        for k in w:
            gk = np.array(g[k], np.float64)
            sq = gk**2 + eps1
            if w[k].ndim >= 2:
                row[k] = b2 * row[k] + (1 - b2) * sq.mean(axis=-1)
                col[k] = b2 * col[k] + (1 - b2) * sq.mean(axis=-2)
                v = np.outer(row[k], col[k]) / row[k].mean()
            else:
                vec[k] = b2 * vec[k] + (1 - b2) * sq
                v = vec[k]
            u = gk / np.sqrt(v)
            u /= max(1.0, np.sqrt((u**2).mean()) / clip)
            step = lr * (max(eps2, np.sqrt((w[k] ** 2).mean())) if scale else 1.0)
            u = step * u
            if beta1 is not None:
                m[k] = beta1 * m[k] + (1 - beta1) * u
                u = m[k]
            d = decay if w[k].ndim >= 2 else 0.0
            w[k] = w[k] * (1 - lr * d) - u
    return w


@pytest.mark.parametrize(
    "over",
    [{}, {"beta1": 0.9, "clip_threshold": 0.5, "scale_parameter": True}],
    ids=["defaults", "momentum-clip-scaled"],
)
def test_adafactor_matches_its_formula_over_several_steps(over):
    from mlxtune.config.schema import AdafactorConfig

    before, grads, lrs = problem(2)
    a = AdafactorConfig(**over)
    cfg = OptimizerConfig(name="adafactor", lr=0.1, weight_decay=0.2, adafactor=a)
    got, opt = run_steps(cfg, before, grads, lrs)
    want = adafactor_reference(
        before, grads, lrs, a.eps[0], a.eps[1], a.clip_threshold, a.decay_rate, a.beta1, 0.2,
        a.scale_parameter,
    )  # fmt: skip
    for k in before:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # factored: a matrix keeps a row and a column, not a full second moment
    state = opt.state["layers"][0]["weight"]
    assert set(state) >= {"exp_avg_sq_row", "exp_avg_sq_col"} and "exp_avg_sq" not in state


def wsd_reference(lr, total, warmup, min_lr, fraction):
    decay = max(1, round(fraction * total))
    start = total - decay
    warmup = min(warmup, start)
    out = []
    for s in range(total):
        if s < warmup:
            out.append(lr * (s + 1) / warmup)
        elif s < start:
            out.append(lr)
        else:
            out.append(lr + (min_lr - lr) * (s - start + 1) / decay)
    return out


@pytest.mark.parametrize(
    "total, warmup, fraction",
    [(100, 10, 0.2), (20, 3, 0.1), (10, 9, 0.3), (7, None, 0.5)],
    ids=["long", "short", "warmup-cut-at-the-decay", "default-warmup"],
)
def test_warmup_stable_decay_step_by_step(total, warmup, fraction):
    s = make_schedule("warmup_stable_decay", 1.0, total, warmup, 0.1, fraction)
    got = [float(s(i)) for i in range(total)]
    w = max(1, int(0.05 * total)) if warmup is None else warmup
    want = wsd_reference(1.0, total, w, 0.1, fraction)
    assert got == pytest.approx(want, rel=1e-6)
    start = total - max(1, round(fraction * total))
    # the warmup never reaches into the decay: lr is reached before the first decaying step,
    # which is already below it, and the last step runs at min_lr
    assert max(got[:start]) == pytest.approx(1.0) and got[start] < 1.0
    assert got[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["linear", "cosine", "warmup_cosine"])
def test_the_decay_starts_after_the_warmup_step_by_step(name):
    s = make_schedule(name, lr=1.0, total_steps=30, warmup_steps=5, min_lr=0.0)
    got = [float(s(i)) for i in range(30)]
    assert got[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # rising, never decaying
    assert got[5] == pytest.approx(1.0) and all(
        a >= b for a, b in zip(got[5:-1], got[6:], strict=True)
    )
    assert got[-1] == pytest.approx(0.0, abs=1e-7)
