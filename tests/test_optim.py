import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxtune.config import OptimizerConfig
from mlxtune.engine.optim import AdamWMatrices, build_optimizer, make_schedule


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
    return stepped(opt, model, grads), opt


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


# ------------------------------------------------------------------ muon
def randomised(model, seed: int, steps: int):
    """``model``'s weights set at random, and ``steps`` random gradients for them (NumPy)."""
    rng = np.random.default_rng(seed)
    before = {
        k: rng.normal(size=v.shape).astype(np.float32)
        for k, v in nn.utils.tree_flatten(model.parameters())
    }
    model.update(nn.utils.tree_unflatten([(k, mx.array(x)) for k, x in before.items()]))
    grads = [
        {k: rng.normal(size=x.shape).astype(np.float32) for k, x in before.items()}
        for _ in range(steps)
    ]
    return before, grads


def stepped(opt, model, grads) -> dict:
    """``model``'s weights after ``opt`` applied each of ``grads``."""
    for g in grads:
        opt.update(model, nn.utils.tree_unflatten([(k, mx.array(x)) for k, x in g.items()]))
        mx.eval(model.parameters())
    return {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}


class Blocks(nn.Module):
    """Embedding, two numbered blocks (a matrix with a bias, a norm), a head: the layout Muon
    splits (matrices inside the blocks to Muon, the rest to AdamW)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(7, 6)
        self.layers = [nn.Linear(6, 4), nn.RMSNorm(4), nn.Linear(4, 6, bias=False)]
        self.lm_head = nn.Linear(6, 7, bias=False)


def newton_schulz(x, steps):
    """The quintic Newton-Schulz iteration Muon orthogonalises with, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def adamw_reference(w, g, m, v, t, lr, b1, b2, eps, decay):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    d = decay if w.ndim >= 2 else 0.0
    w = w * (1 - lr * d) - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return w, m, v


def muon_reference(
    weights, grads, lrs, scale, mom, nesterov, ns, decay, decay_scale, muon, times=None
):
    """Muon on the names in ``muon`` (momentum, Nesterov, Newton-Schulz, lr x scale x
    sqrt(max(1, out / in)), decoupled decay at Muon's lr), AdamW on the rest, float64; a
    name in ``times`` at that multiple of the lr."""
    times = times or {}
    w = {k: np.array(x, np.float64) for k, x in weights.items()}
    m = {k: np.zeros_like(x) for k, x in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    for t, (g, base) in enumerate(zip(grads, lrs, strict=True), start=1):
        for k in w:
            gk = np.array(g[k], np.float64)
            lr = base * times.get(k, 1.0)
            if k not in muon:
                w[k], m[k], v[k] = adamw_reference(
                    w[k], gk, m[k], v[k], t, lr, 0.9, 0.999, 1e-8, decay
                )
                continue
            m[k] = mom * m[k] + (1 - mom) * gk
            u = (1 - mom) * gk + mom * m[k] if nesterov else m[k]
            rows, cols = w[k].shape
            if k.endswith(("lora_a", "lora_b")):  # stored [in, out]: the factor is out / in
                rows, cols = cols, rows
            step = lr * scale * math.sqrt(max(1.0, rows / cols))
            w[k] = w[k] * (1 - lr * scale * decay * decay_scale) - step * newton_schulz(u, ns)
    return w


@pytest.mark.parametrize(
    "over", [{}, {"nesterov": False, "ns_steps": 3, "lr_scale": 2.0, "weight_decay_scale": 3.0}]
)
def test_muon_on_block_matrices_adamw_on_the_rest_over_several_steps(over):
    from mlxtune.config.schema import MuonConfig

    model = Blocks()
    before, grads = randomised(model, seed=3, steps=5)
    lrs = [0.01, 0.02, 0.015, 0.005, 0.01]
    m = MuonConfig(**over)
    cfg = OptimizerConfig(name="muon", lr=0.01, weight_decay=0.1, muon=m)
    opt = build_optimizer(cfg, lambda step: mx.array(lrs)[step])
    got = stepped(opt, model, grads)
    muon = {"layers.0.weight", "layers.2.weight"}  # not the embedding, head, bias or norm
    want = muon_reference(
        before, grads, lrs, m.lr_scale, m.momentum, m.nesterov, m.ns_steps, 0.1,
        m.weight_decay_scale, muon,
    )  # fmt: skip
    for k in before:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-5, err_msg=k)
    # the reported learning rate is the recipe's (AdamW's), not Muon's multiple of it
    assert float(opt.learning_rate) == pytest.approx(lrs[-1])


class LoRAish(nn.Module):
    """A block holding a frozen-style matrix, LoRA's A [in, r] and B [r, out], and a norm."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(6, 5), nn.RMSNorm(5)]
        self.layers[0].lora_a = mx.zeros((6, 2))
        self.layers[0].lora_b = mx.zeros((2, 5))


@pytest.mark.parametrize(
    "name, adapters", [("adamw", False), ("muon", True), ("muon", False)], ids=str
)
def test_lora_plus_trains_b_at_its_multiple_of_the_lr(name, adapters):
    """LoRA+: B at ratio x the lr (its decay too), A and the rest at the lr; with Muon on the
    adapters, B is Muon's at ratio x Muon's lr."""
    from mlxtune.config.schema import MuonConfig

    model = LoRAish()
    before, grads = randomised(model, seed=4, steps=4)
    lrs = [0.01, 0.02, 0.015, 0.005]
    m = MuonConfig(adapters=adapters, lr_scale=2.0)
    cfg = OptimizerConfig(name=name, lr=0.01, weight_decay=0.1, muon=m)
    opt = build_optimizer(cfg, lambda step: mx.array(lrs)[step], lora_plus_ratio=3.0)
    got = stepped(opt, model, grads)
    muon = set()
    if name == "muon":
        muon = {"layers.0.weight"} | ({"layers.0.lora_a", "layers.0.lora_b"} if adapters else set())
    want = muon_reference(
        before, grads, lrs, m.lr_scale, m.momentum, m.nesterov, m.ns_steps, 0.1, 1.0, muon,
        times={"layers.0.lora_b": 3.0},
    )  # fmt: skip
    for k in before:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-5, err_msg=k)


# ------------------------------------------------------------------ sophia
def sophia_reference(weights, grads, curv, lrs, b1, b2, rho, eps, decay):
    """Sophia-G in float64: before step t, when ``curv[t]`` is (g, count, ok), h <- b2 h +
    (1 - b2) count g^2 (kept when not ok); m <- b1 m + (1 - b1) grad; w <- w (1 - lr wd) - lr
    sign(m) min(|m| / max(rho h, eps), 1), the decay on matrices only."""
    w = {k: np.array(v, np.float64) for k, v in weights.items()}
    m = {k: np.zeros_like(x) for k, x in w.items()}
    h = {k: np.zeros_like(x) for k, x in w.items()}
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True)):
        if curv[t] is not None:
            gh, count, ok = curv[t]
            if ok:
                h = {k: b2 * h[k] + (1 - b2) * count * np.float64(gh[k]) ** 2 for k in w}
        for k in w:
            m[k] = b1 * m[k] + (1 - b1) * np.array(g[k], np.float64)
            ratio = np.minimum(np.abs(m[k]) / np.maximum(rho * h[k], eps), 1.0)
            d = decay if w[k].ndim >= 2 else 0.0
            w[k] = w[k] * (1 - lr * d) - lr * np.sign(m[k]) * ratio
    return w


def test_sophia_matches_its_formula_with_curvature_every_other_step():
    from mlxtune.config.schema import SophiaConfig

    before, grads, lrs = problem(5)
    rng = np.random.default_rng(6)
    curv = [
        (
            {k: rng.normal(size=x.shape).astype(np.float32) * 0.3 for k, x in before.items()},
            37.0,
            t != 4,  # a non-finite estimate is left out
        )
        if t % 2 == 0
        else None
        for t in range(len(grads))
    ]
    sc = SophiaConfig(betas=[0.9, 0.95], rho=0.05, k=2)
    cfg = OptimizerConfig(name="sophia", lr=0.1, weight_decay=0.2, sophia=sc)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5))
    model.update(nn.utils.tree_unflatten([(k, mx.array(v)) for k, v in before.items()]))
    opt = build_optimizer(cfg, lambda step: mx.array(lrs)[step])
    assert opt.curvature_every == 2
    opt.init(model.trainable_parameters())
    tree = nn.utils.tree_unflatten
    for g, c in zip(grads, curv, strict=True):
        if c is not None:
            gh, count, ok = c
            opt.update_curvature(
                tree([(k, mx.array(x)) for k, x in gh.items()]), mx.array(count), mx.array(ok)
            )
        opt.update(model, tree([(k, mx.array(x)) for k, x in g.items()]))
        mx.eval(model.parameters())
    got = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
    want = sophia_reference(before, grads, curv, lrs, 0.9, 0.95, 0.05, sc.eps, 0.2)
    for k in before:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------ adamw8bit
def q8(x, signed, block=256):
    """Blockwise companded 8-bit codes, in float32 NumPy: per block of 256 the largest magnitude
    s; signed codes round(127 sign(x) (|x|/s)^(1/4)), unsigned round(255 (x/s)^(1/4)),
    at least 1 for x > 0."""
    flat = np.concatenate([x.ravel(), np.zeros((-x.size) % block, np.float32)]).astype(np.float32)
    b = flat.reshape(-1, block)
    s = np.abs(b).max(axis=1, keepdims=True)
    u = np.abs(b) / np.maximum(s, np.float32(1e-38))
    if signed:
        return np.round(127 * np.sqrt(np.sqrt(u))) * np.sign(b), s
    c = np.round(255 * np.sqrt(np.sqrt(u)))
    return np.where(u > 0, np.maximum(c, 1), 0), s


def dq8(c, s, signed, shape):
    u = np.sign(c) * (c / 127) ** 4 if signed else (c / 255) ** 4
    return (u * s).astype(np.float32).ravel()[: int(np.prod(shape))].reshape(shape)


def adamw8bit_reference(weights, grads, lrs, b1, b2, eps, decay):
    """AdamW whose moments of weights with 4096+ elements are stored as 8-bit codes between
    steps (float32, as stored)."""
    w = {k: np.array(v, np.float32) for k, v in weights.items()}
    st = {k: (np.zeros_like(x), np.zeros_like(x)) for k, x in w.items()}
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        for k in w:
            m, v = st[k]
            gk = np.array(g[k], np.float32)
            m = b1 * m + (1 - b1) * gk
            v = b2 * v + (1 - b2) * gk**2
            if w[k].size >= 4096:  # what the next step reads back
                st[k] = (dq8(*q8(m, True), True, m.shape), dq8(*q8(v, False), False, v.shape))
            else:
                st[k] = (m, v)
            d = decay if w[k].ndim >= 2 else 0.0
            mh, vh = m / (1 - b1**t), v / (1 - b2**t)
            w[k] = w[k] * (1 - lr * d) - lr * mh / (np.sqrt(vh) + eps)
    return w


def test_adamw8bit_matches_its_formula_and_stays_near_adamw():
    rng = np.random.default_rng(8)
    model = nn.Sequential(nn.Linear(100, 50), nn.LayerNorm(50))  # 5000 weights: 20 blocks
    before = {
        k: rng.normal(size=v.shape).astype(np.float32)
        for k, v in nn.utils.tree_flatten(model.parameters())
    }
    # gradients of mixed scales, so that a block holds large and tiny moments
    grads = [
        {k: (rng.normal(size=x.shape) * 10.0 ** rng.integers(-4, 1, x.shape)).astype(np.float32)
         for k, x in before.items()}
        for _ in range(8)
    ]  # fmt: skip
    lrs = [1e-2] * 8
    results = {}
    for name in ("adamw8bit", "adamw"):
        model.update(nn.utils.tree_unflatten([(k, mx.array(x)) for k, x in before.items()]))
        opt = build_optimizer(
            OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1), lambda step: mx.array(1e-2)
        )
        for g in grads:
            opt.update(model, nn.utils.tree_unflatten([(k, mx.array(x)) for k, x in g.items()]))
            mx.eval(model.parameters(), opt.state)
        results[name] = {k: np.array(v) for k, v in nn.utils.tree_flatten(model.parameters())}
        if name == "adamw8bit":
            state = dict(nn.utils.tree_flatten(opt.state))
            assert state["layers.0.weight.m_q"].dtype == mx.int8  # stored as 8-bit codes
            small = state["layers.1.weight.m"]  # a 50-element norm keeps fp32
            assert small.dtype == mx.float32
            bytes8 = sum(v.nbytes for k, v in state.items() if k.startswith("layers.0.weight"))
    want = adamw8bit_reference(before, grads, lrs, 0.9, 0.999, 1e-8, 0.1)
    for k in before:
        # a code on a rounding boundary may round the other way in float32 (seen: 24 of 5000
        # weights after 8 steps, each off by less than a code step's share of an update)
        off = np.abs(results["adamw8bit"][k] - want[k]) > 1e-5 + 1e-4 * np.abs(want[k])
        assert off.mean() < 0.02 and np.abs(results["adamw8bit"][k] - want[k]).max() < 2e-3
    # close to fp32 AdamW: the weights' change within a few percent, with gradients spanning
    # four orders of magnitude in each block
    for k in before:
        moved = results["adamw"][k] - before[k]
        err = np.linalg.norm(results["adamw8bit"][k] - results["adamw"][k]) / np.linalg.norm(moved)
        assert err < 0.05, (k, err)  # measured 3.0% for the 8-bit matrix, 1e-6 for the rest
    # a quarter of fp32 Adam's 2 x 4 bytes a weight, and the blocks' scales
    assert bytes8 == 2 * (5120 + 4 * 20) and bytes8 / (8 * 5000) < 0.27
