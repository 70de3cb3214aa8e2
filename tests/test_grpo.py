"""GRPO: every loss variant against its formula written here over full logits (values and
gradients), clipping at both bounds, the k3 KL, the entropy mask (entropies, quantile and
masked loss from full logits), group advantages against NumPy float64 from
rewards recomputed here, reward functions (built-ins, the user's, and their errors), prompt
data and its errors, exact resume inside a rollout, offline groups, and learning on the shipped
quickstart-grpo task measured with mlx-lm's own generation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import (
    REPO,
    TIMING,
    make_crash,
    objective_recipe,
    prompt_rows,
    refused_run,
    run_rows,
    same_gradients,
    same_rows,
    shipped_recipe,
    write_jsonl,
)
from conftest import build_run as build
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.objectives.grpo import high_entropy
from mlxtune.rewards import RewardSpec, build_rewards, score

TIMING = TIMING | {"generation_s", "generation_tokens_per_sec"}


def rows(run_dir):
    """A run's metrics rows without their timings, generation's among them."""
    return run_rows(run_dir, TIMING)


def recipe(prompts, model_dir, objective=None, **over):
    obj = {
        "type": "grpo",
        "num_generations": 4,
        "max_completion_length": 6,
        "rewards": [{"name": "length", "target": 3}],
    }
    obj.update(objective or {})
    return objective_recipe("grpo", model_dir, prompts, obj, max_length=24, batch_size=3, **over)


def completions(batch):
    """Each row's completion tokens (the targets), as the batch holds them."""
    out = []
    for t, m in zip(batch.tokens, batch.mask, strict=True):
        out.append([int(x) for x, keep in zip(t, m, strict=True) if keep])
    return out


# ------------------------------------------------------------------------ naive references
def token_logps(model, ids):
    """[T-1] log p(ids[j+1] | ids[:j+1]) over the model's full logits (MLX, differentiable)."""
    logits = model(mx.array([ids[:-1]]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1)[:, 0]


def token_entropies(model, ids):
    """[T-1] the entropy of the model's next-token distribution at each position, float64
    NumPy from its full logits: -sum p log p."""
    z = np.array(model(mx.array([ids[:-1]]))[0].astype(mx.float32), np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(axis=-1)


def naive_entropy_mask(model, batch, top):
    """TRL's get_high_entropy_mask written out: every completion token's entropy, the
    (1 - top) quantile of them all (torch.quantile's linear interpolation, by hand), and each
    completion's mask of the tokens at or above it: (masks, entropies, threshold)."""
    ents = []
    for i, (t, m) in enumerate(zip(batch.tokens, batch.mask, strict=True)):
        n = int(batch.lengths[i])
        where = [j for j in range(n - 1) if m[j + 1]]
        ents.append(token_entropies(model, [int(x) for x in t[:n]])[where])
    flat = np.sort(np.concatenate(ents))
    pos = (1 - top) * (len(flat) - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, len(flat) - 1)
    threshold = flat[lo] + (pos - lo) * (flat[hi] - flat[lo])
    return [e >= threshold for e in ents], np.concatenate(ents), threshold


def naive_grpo(model, batch, old, ref, cfg, keep=None, is_weight=None):
    """TRL's GRPO loss, written out completion by completion: (loss, each completion's count of
    tokens clipped low and high and its KL sum, as [R, 3] float64). ``keep``: each
    completion's entropy mask, which multiplies the policy term alone (TRL's order)."""
    el = cfg["epsilon"]
    eh = cfg.get("epsilon_high") or el
    beta, kind = cfg.get("beta", 0.0), cfg.get("loss", "dapo")
    seq_sums, seq_ns, stats = [], [], []
    for i, (t, m) in enumerate(zip(batch.tokens, batch.mask, strict=True)):
        n = int(batch.lengths[i])
        where = [j for j in range(n - 1) if m[j + 1]]
        lp = token_logps(model, [int(x) for x in t[:n]])[mx.array(where)]
        o = mx.array(old[i][where])
        lr = lp - o
        if cfg.get("importance_sampling") == "sequence":
            lr = mx.mean(lr) * mx.ones(len(where))
        c1 = mx.exp(lr)
        c2 = mx.clip(c1, 1 - el, 1 + eh)
        a = float(batch.advantages[i])
        if kind == "cispo":  # ScaleRL's CISPO as TRL writes it: -sg(min(r, eps_max)) A log p
            per = -mx.stop_gradient(mx.minimum(c1, eh)) * a * lp
        elif kind == "sapo":  # SAPO: -sigmoid(tau (r - 1)) 4 / tau A, tau by A's sign
            tau = (
                cfg.get("sapo_temperature_pos", 1.0)
                if a > 0
                else cfg.get("sapo_temperature_neg", 1.05)
            )
            per = -mx.sigmoid(tau * (c1 - 1)) * 4 / tau * a
        else:
            per = -mx.minimum(c1 * a, c2 * a)
        if keep is not None:
            per = per * mx.array(keep[i].astype(np.float32))
        if is_weight is not None:  # after the entropy mask, before the KL term (TRL's order)
            per = per * mx.array(is_weight[i].astype(np.float32))
        kl = 0.0
        if beta:
            d = mx.array(ref[i][where]) - lp
            per = per + beta * (mx.exp(d) - d - 1)
            kl = float(mx.sum(mx.exp(d) - d - 1))
        low, high = float(mx.sum((c1 < 1 - el) & (a < 0))), float(mx.sum((c1 > 1 + eh) & (a > 0)))
        capped = float(mx.sum((c1 > eh) & (a > 0)))  # CISPO's cap on the ratio itself
        stats.append((low, high, kl, capped))
        seq_sums.append(mx.sum(per))
        seq_ns.append(len(where))
    stats = np.array(stats, np.float64)
    if kind in ("dapo", "cispo"):
        return sum(seq_sums) / sum(seq_ns), stats
    if kind in ("grpo", "sapo"):
        return sum(s / k for s, k in zip(seq_sums, seq_ns, strict=True)) / len(seq_ns), stats
    return sum(seq_sums) / (len(seq_ns) * cfg["max_completion_length"]), stats


def perturb(model, batch, cfg):
    """Old log-probs that put ratios on both sides of both clip bounds, a reference (beta),
    and advantages of both signs, seeded."""
    rng = np.random.default_rng(0)
    shift = rng.choice([-0.5, -0.05, 0.05, 0.5], size=batch.mask[:, 1:].shape)
    cur = np.zeros(batch.mask[:, 1:].shape, np.float32)
    for i in range(len(batch.tokens)):
        n = int(batch.lengths[i])
        cur[i, : n - 1] = np.array(token_logps(model, [int(x) for x in batch.tokens[i, :n]]))
    batch.old = (cur + shift).astype(np.float32)
    batch.ref = (cur + rng.normal(0, 0.3, cur.shape)).astype(np.float32)
    if not cfg.get("beta"):
        batch.ref = None
    batch.advantages = rng.normal(0, 1, len(batch.tokens)).astype(np.float32)


VARIANTS = [
    {"loss": "dapo"},
    {"loss": "grpo"},
    {"loss": "dr_grpo"},
    {"loss": "dapo", "epsilon_high": 0.28, "beta": 0.1},
    {"loss": "grpo", "importance_sampling": "sequence", "beta": 0.05},
    {"loss": "dr_grpo", "importance_sampling": "sequence", "epsilon": 0.1},
    {"loss": "cispo", "epsilon_high": 1.2},
    {"loss": "cispo", "epsilon_high": 1.2, "importance_sampling": "sequence", "beta": 0.05},
    {"loss": "sapo"},
    {"loss": "sapo", "sapo_temperature_pos": 2.0, "beta": 0.1},
]


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_importance_sampling_correction_weights_by_the_truncated_ratio(
    tmp_path, llama_dir, prompts, mode
):
    """The weights exp(p_old - p_sampled), per token or the completion's summed log-ratio,
    truncated at the cap, multiply the policy term (TRL's order: before the KL term): written out
    in float64 over the rollout's own targets. The sampler's log-probs, recorded as each token
    was drawn, are the trainer's (both at temperature 1): the rollout's own weights are 1."""
    v = {"importance_sampling_correction": mode, "importance_sampling_cap": 1.5, "beta": 0.1}
    cfg = {"epsilon": 0.2, "max_completion_length": 6, "loss": "dapo", **v}
    t = build(recipe(prompts, llama_dir, v), tmp_path)
    obj = t.objective
    batch = next(obj.batches())[1]
    m = batch.mask[:, 1:] > 0
    np.testing.assert_allclose(batch.is_weight[m], 1.0, atol=2e-4)
    assert batch.host["is_weight"][1] == m.sum()
    perturb(t.model, batch, cfg)
    cur = np.zeros(m.shape, np.float64)
    for i in range(len(batch.tokens)):
        n = int(batch.lengths[i])
        cur[i, : n - 1] = np.array(token_logps(t.model, [int(x) for x in batch.tokens[i, :n]]))
    rng = np.random.default_rng(1)
    shift = rng.choice([-0.8, -0.1, 0.1, 0.8], size=m.shape)
    drawn = [list((cur[i] + shift[i])[m[i]]) for i in range(len(m))]
    obj._is_weights(batch, cur.astype(np.float32), drawn)
    d = np.where(m, -shift, 0.0)
    if mode == "sequence":
        d = np.broadcast_to(d.sum(axis=1, keepdims=True), d.shape)
    want_w = np.minimum(np.exp(d), 1.5)
    assert (want_w[m] == 1.5).any() and (want_w[m] < 1).any()  # truncated, and both sides of 1
    np.testing.assert_allclose(batch.is_weight[m], want_w[m], rtol=1e-5)
    each = [want_w[i][m[i]] for i in range(len(m))]
    want, _ = naive_grpo(t.model, batch, batch.old, batch.ref, cfg, is_weight=each)
    loss, count, _ = obj.loss(t.model, t.engine.arrays(batch))
    assert loss.item() / count.item() == pytest.approx(want.item(), rel=2e-5, abs=1e-6)


@pytest.mark.parametrize(
    "variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items())
)
def test_each_loss_is_its_formula_in_values_and_gradients(tmp_path, llama_dir, prompts, variant):
    cfg = {"epsilon": 0.2, "max_completion_length": 6, **variant}
    t = build(recipe(prompts, llama_dir, variant), tmp_path)
    obj = t.objective
    batch = next(obj.batches())[1]
    tokens = cfg["loss"] in ("dapo", "cispo")
    assert obj.count(batch) == (batch.n_targets if tokens else len(batch.tokens))
    perturb(t.model, batch, cfg)
    arrays = t.engine.arrays(batch)
    want, stats = naive_grpo(t.model, batch, batch.old, batch.ref, cfg)
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == obj.count(batch)
    assert loss.item() / count.item() == pytest.approx(want.item(), rel=2e-5, abs=1e-6)
    # the metrics add up as the loss counts: over tokens (dapo), or each completion's mean
    ns = batch.mask[:, 1:].sum(axis=1)
    summed = stats.sum(axis=0) if tokens else (stats / ns[:, None]).sum(axis=0)
    clipping = cfg["loss"] not in ("cispo", "sapo")
    if cfg.get("importance_sampling") != "sequence" and clipping:
        assert stats[:, 0].sum() > 0 and stats[:, 1].sum() > 0  # both bounds were reached
    for k, j in (("clip_ratio/low", 0), ("clip_ratio/high", 1), ("kl", 2)):
        if k in metrics:
            assert metrics[k].item() == pytest.approx(summed[j], rel=1e-4, abs=1e-5), k
    if clipping:
        want_clip = summed[0] + summed[1]
        assert metrics["clip_ratio"].item() == pytest.approx(want_clip, rel=1e-4, abs=1e-5)
    assert ("clip_ratio" in metrics) == clipping
    if cfg["loss"] == "cispo":  # ratios capped where the advantage is positive
        assert metrics["cispo_clip_ratio"].item() == pytest.approx(summed[3], rel=1e-4, abs=1e-5)
        assert summed[3] > 0 or cfg.get("importance_sampling") == "sequence"
    assert ("kl" in metrics) == bool(cfg.get("beta"))

    def naive(model):
        return naive_grpo(model, batch, batch.old, batch.ref, cfg)[0]

    n = count.item()
    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0] / n, rtol=3e-4)


def peaked(t):
    """The run's model with its final norm x 4: distributions from near-certain to near-uniform
    (a random one's are all near uniform), so that entropies spread out."""
    norm = t.model.model.norm
    norm.weight = norm.weight * 4
    return t


@pytest.mark.parametrize(
    "variant",
    [
        {"loss": "dapo", "beta": 0.1},
        {"loss": "grpo", "importance_sampling": "sequence"},
        {"loss": "dr_grpo", "micro_batch_size": 5},
        {"loss": "cispo", "epsilon_high": 1.2},
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_the_entropy_mask_keeps_the_policy_term_of_high_entropy_tokens(
    tmp_path, llama_dir, prompts, variant
):
    """entropy_mask 0.3, as TRL's top_entropy_quantile 0.3: the mask is the batch's completion
    tokens at or above the 0.7 quantile of their entropies, written here from full logits; it
    multiplies the policy term only (the KL term and the normalisation counts are the
    unmasked ones), in values and gradients; the quantile is the whole batch's whatever its
    passes (micro_batch_size 5: three passes)."""
    top = 0.3
    cfg = {"epsilon": 0.2, "max_completion_length": 6, **variant, "entropy_mask": top}
    t = peaked(build(recipe(prompts, llama_dir, cfg), tmp_path))
    obj = t.objective
    batch = next(obj.batches())[1]
    keep, ents, threshold = naive_entropy_mask(t.model, batch, top)
    # clear of every entropy, so that fp32 and float64 draw the same line
    assert np.abs(ents - threshold).min() > 1e-4
    got = [batch.keep[i, np.flatnonzero(batch.mask[i, 1:])] for i in range(len(batch.tokens))]
    for g, k in zip(got, keep, strict=True):
        np.testing.assert_array_equal(g, k.astype(np.float32))
    assert batch.keep.sum() == sum(k.sum() for k in keep) == np.ceil(top * len(ents))
    assert not batch.keep[batch.mask[:, 1:] == 0].any()
    entropy = obj.host_metrics(batch)["entropy"]  # TRL's metric: the tokens' mean entropy
    assert entropy[0] / entropy[1] == pytest.approx(ents.mean(), rel=1e-5)
    perturb(t.model, batch, cfg)
    want, stats = naive_grpo(t.model, batch, batch.old, batch.ref, cfg, keep)
    unmasked = naive_grpo(t.model, batch, batch.old, batch.ref, cfg)[0]
    assert abs(want.item() - unmasked.item()) > 1e-3  # the mask matters here
    parts = obj.micro(batch)
    assert len(parts) == (3 if "micro_batch_size" in variant else 1)
    n = obj.count(batch)
    total = sum(obj.loss(t.model, t.engine.arrays(p))[0].item() for p in parts)
    assert total / n == pytest.approx(want.item(), rel=2e-5, abs=1e-6)
    if cfg.get("beta"):  # the KL is every token's, unmasked, as the loss counts it
        kl = obj.loss(t.model, t.engine.arrays(batch))[2]["kl"].item()
        assert kl == pytest.approx(stats[:, 2].sum(), rel=1e-4, abs=1e-5)

    def naive(model):
        return naive_grpo(model, batch, batch.old, batch.ref, cfg, keep)[0]

    arrays = t.engine.arrays(batch)
    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0] / n, rtol=3e-4)


def test_the_entropy_mask_is_the_policys_as_each_step_starts(tmp_path, llama_dir, prompts):
    """num_iterations 2: the rollout's rows are handed out again after a step, and their mask
    and entropies are then the updated policy's (TRL computes them in each step's forward),
    not the generating one's."""
    cfg = {"num_iterations": 2, "entropy_mask": 0.3}
    t = peaked(build(recipe(prompts, llama_dir, cfg, optimizer={"lr": 0.05}), tmp_path))
    batches = t.objective.batches()
    first = next(batches)[1]
    t.engine.step(t.engine.micro_batches([first]))
    mx.eval(t.model.parameters())
    again = next(batches)[1]
    assert np.array_equal(again.tokens, first.tokens)
    keep, ents, threshold = naive_entropy_mask(t.model, again, 0.3)
    assert np.abs(ents - threshold).min() > 1e-4
    mean = again.host["entropy"][0] / again.host["entropy"][1]
    assert mean == pytest.approx(ents.mean(), rel=1e-5)
    assert abs(mean - first.host["entropy"][0] / first.host["entropy"][1]) > 1e-3
    for i, k in enumerate(keep):
        np.testing.assert_array_equal(again.keep[i, np.flatnonzero(again.mask[i, 1:])], k)


def test_the_entropies_are_the_models_own_under_a_soft_cap(
    tmp_path, model_dir_factory, tokenizer_dir, prompts
):
    """gemma2 (logits soft-capped at 5), on offline groups: the entropies the mask reads,
    through the head's kernel at the target positions only, are those of the model's own
    logits."""
    groups = [
        {"prompt": r["prompt"], "responses": [" " + r["answer"], " x"], "rewards": [1.0, 0.0]}
        for r in prompt_rows(6, 5)
    ]
    write_jsonl(tmp_path / "off" / "train.jsonl", groups)
    write_jsonl(tmp_path / "off" / "valid.jsonl", groups[:2])
    r = recipe(tmp_path / "off", model_dir_factory("gemma2"), {"entropy_mask": 0.5, "rewards": []})
    r["tokenizer"] = {"path": str(tokenizer_dir)}
    t = build(r, tmp_path)
    obj = t.objective
    assert obj.components.lm.softcap == 5.0
    batch = next(obj.batches())[1]
    arrays = t.engine.arrays(batch)
    assert "rows" in arrays  # the prompts' positions skip the head
    # the offline evaluation's loss masks its batches as training does
    for b in obj.eval_batches():
        assert np.ceil(0.5 * b.n_targets) <= b.keep.sum() < b.n_targets
    got = np.array(obj.token_entropies(arrays))
    assert not got[batch.mask[:, 1:] == 0].any()
    for i, (tok, m) in enumerate(zip(batch.tokens, batch.mask, strict=True)):
        n = int(batch.lengths[i])
        where = [j for j in range(n - 1) if m[j + 1]]
        want = token_entropies(t.model, [int(x) for x in tok[:n]])[where]
        np.testing.assert_allclose(got[i, where], want, rtol=1e-5, atol=1e-5)


def test_entropy_mask_1_is_no_mask_and_the_quantile_is_torchs():
    """The mask as TRL's get_high_entropy_mask takes it: over the targets only, linear
    interpolation, entropies at or above the threshold (ties all kept); 1.0 keeps every
    target."""
    ent = np.array([[0.1, 0.5, 0.3, 0.9, 0.7, 5.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0]])  # the last is no target: neither counted nor kept
    # the 0.6 quantile of (0.1, 0.3, 0.5, 0.7, 0.9): position 2.4, 0.5 + 0.4 x 0.2 = 0.58
    np.testing.assert_array_equal(high_entropy(ent, mask, 0.4), [[0, 0, 0, 1, 1, 0]])
    np.testing.assert_array_equal(high_entropy(ent, mask, 1.0), [[1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(high_entropy(ent, mask, 0.01), [[0, 0, 0, 1, 0, 0]])
    ties = np.full((1, 4), 0.5, np.float32)
    np.testing.assert_array_equal(high_entropy(ties, np.ones((1, 4)), 0.2), [[1, 1, 1, 1]])
    assert not high_entropy(ent, np.zeros_like(mask), 0.2).any()


def test_entropy_mask_1_trains_as_no_mask(tmp_path, llama_dir, prompts):
    """entropy_mask 1.0 is every token (no entropy forward, no mask): the loss and rows of a
    run without the key; a mask of 0.5 changes them, and logs the tokens' mean entropy."""
    rows_of = {}
    for name, top in (("none", None), ("all", 1.0), ("half", 0.5)):
        obj = {"beta": 0.05} if top is None else {"beta": 0.05, "entropy_mask": top}
        r = recipe(prompts, llama_dir, obj, max_steps=2)
        build(r, tmp_path, name).run()
        rows_of[name] = rows(tmp_path / name)
    same_rows(rows_of["all"], rows_of["none"], 0, 0)
    train = [x for x in rows_of["half"] if "loss" in x]
    assert all(x["entropy"] > 0 for x in train)
    assert all("entropy" not in x for x in rows_of["none"])
    assert [x["loss"] for x in train] != [x["loss"] for x in rows_of["none"] if "loss" in x]


def test_on_the_first_iteration_the_loss_is_the_policy_gradient(tmp_path, llama_dir, prompts):
    """With no kept log-probs (num_iterations 1) the ratio is 1 and the gradient is
    -sum(A x grad log p) / tokens: REINFORCE with the group baseline, written here."""
    t = build(recipe(prompts, llama_dir), tmp_path)
    obj = t.objective
    batch = next(obj.batches())[1]
    assert batch.old is None
    arrays = t.engine.arrays(batch)
    n = obj.count(batch)

    def reinforce(model):
        total = 0.0
        for i, (tok, m) in enumerate(zip(batch.tokens, batch.mask, strict=True)):
            k = int(batch.lengths[i])
            where = [j for j in range(k - 1) if m[j + 1]]
            lp = token_logps(model, [int(x) for x in tok[:k]])[mx.array(where)]
            total = total - float(batch.advantages[i]) * mx.sum(lp)
        return total / n

    _, want_g = nn.value_and_grad(t.model, reinforce)(t.model)
    loss, got_g = nn.value_and_grad(t.model, lambda m: obj.loss(m, arrays)[0] / n)(t.model)
    for k, w in tree_flatten(want_g):
        np.testing.assert_allclose(
            np.array(dict(tree_flatten(got_g))[k]), np.array(w), rtol=3e-4, atol=2e-6, err_msg=k
        )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_rewards_against_the_group_mean(tmp_path, llama_dir, prompts, scale):
    t = build(recipe(prompts, llama_dir, {"scale_rewards": scale}), tmp_path)
    batch = next(t.objective.batches())[1]
    eos = t.tokenizer.eos_token_id
    # the length reward recomputed here from the completions the batch trains on
    lens = np.array([len([x for x in c if x != eos]) for c in completions(batch)], np.float64)
    r = np.maximum(0.0, 1 - np.abs(lens - 3) / 3).reshape(-1, 4)
    a = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        a = a / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        a = a / (r.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(batch.advantages, a.reshape(-1), rtol=1e-5, atol=1e-6)
    assert batch.groups == (4, 4, 4)
    host = t.objective.host_metrics(batch)
    assert host["reward"][0] / host["reward"][1] == pytest.approx(r.mean())
    assert host["completion_length"][0] / host["completion_length"][1] == pytest.approx(
        np.mean([len(c) for c in completions(batch)])
    )


def test_a_group_shares_its_prompt_and_rows_end_at_eos(tmp_path, llama_dir, prompts):
    t = build(recipe(prompts, llama_dir, {"max_completion_length": 6}), tmp_path)
    batch = next(t.objective.batches())[1]
    eos = t.tokenizer.eos_token_id
    train = [json.loads(x) for x in (prompts / "train.jsonl").read_text().splitlines()]
    heads = {tuple(t.tokenizer.encode(r["prompt"])) for r in train}
    for i, c in enumerate(completions(batch)):
        n = int(batch.lengths[i])
        prompt = tuple(int(x) for x in batch.tokens[i, : n - len(c)])
        assert prompt in heads
        assert prompt == tuple(int(x) for x in batch.tokens[i // 4 * 4, : len(prompt)])
        # a completion ends with EOS, or runs to the limit without one
        assert (c[-1] == eos and eos not in c[:-1]) or (len(c) == 6 and eos not in c)


def test_splits_keep_groups_whole_and_sum_to_the_batch(tmp_path, llama_dir, prompts):
    t = build(recipe(prompts, llama_dir), tmp_path)
    obj = t.objective
    batch = next(obj.batches())[1]
    whole = obj.loss(t.model, t.engine.arrays(batch))
    for parts in (2, 3):
        pieces = obj.split(batch, parts)
        assert all(len(p.tokens) % 4 == 0 for p in pieces)
        assert sum(obj.count(p) for p in pieces) == obj.count(batch)
        got = [obj.loss(t.model, t.engine.arrays(p)) for p in pieces]
        assert sum(g[0].item() for g in got) == pytest.approx(whole[0].item(), rel=1e-5, abs=1e-6)
    empty = obj.nothing(batch)
    loss, count, _ = obj.loss(t.model, t.engine.arrays(empty))
    assert loss.item() == 0 and count.item() == 0 == obj.count(empty)


def test_passes_cut_groups_and_add_up_to_the_batch(tmp_path, llama_dir, prompts):
    """micro_batch_size 3 over 3 groups of 4: four passes of 3 rows, groups cut between them;
    more parts than groups split rows too."""
    t = build(recipe(prompts, llama_dir, {"micro_batch_size": 3}), tmp_path)
    obj = t.objective
    batch = next(obj.batches())[1]
    whole = obj.loss(t.model, t.engine.arrays(batch))[0].item()
    for pieces in (obj.micro(batch), obj.split(batch, 5)):
        sizes = [len(p.tokens) for p in pieces]
        assert sum(sizes) == 12 and max(sizes) - min(sizes) <= 1
        assert np.array_equal(np.concatenate([p.tokens for p in pieces]), batch.tokens)
        assert np.array_equal(np.concatenate([p.advantages for p in pieces]), batch.advantages)
        for p in pieces:
            assert sum(p.groups) == len(p.tokens)
        # the group pieces, laid end to end, are the batch's groups
        ends = np.cumsum([g for p in pieces for g in p.groups])
        assert set(np.cumsum(batch.groups)) <= set(ends)
        assert [p.prompts for p in pieces] == [3] + [0] * (len(pieces) - 1)
        assert sum(obj.count(p) for p in pieces) == obj.count(batch)
        got = sum(obj.loss(t.model, t.engine.arrays(p))[0].item() for p in pieces)
        assert got == pytest.approx(whole, rel=1e-5, abs=1e-6)
    assert [p.groups for p in obj.micro(batch)] == [(3,), (1, 2), (2, 1), (3,)]


@pytest.mark.parametrize("entropy_mask", [None, 0.3])
def test_passes_train_the_same_update_as_the_whole_batch(
    tmp_path, llama_dir, prompts, entropy_mask
):
    """A run in passes of 3 completions (the old and reference log-probs too, and the
    entropies of the batch's mask) gives the rows of one that takes each batch in one pass."""
    obj = {"num_iterations": 2, "beta": 0.05, "entropy_mask": entropy_mask}
    for name, size in (("whole", 64), ("cut", 3)):
        t = build(recipe(prompts, llama_dir, {**obj, "micro_batch_size": size}), tmp_path, name)
        (peaked(t) if entropy_mask else t).run()  # entropies clear of the quantiles
    whole, cut = rows(tmp_path / "whole"), rows(tmp_path / "cut")
    assert any(x.get("kl", 0) > 0 for x in whole)
    same_rows(cut, whole, rel=2e-4, abs=1e-5)


# ------------------------------------------------------------------------ rewards
def test_builtin_rewards_score_as_documented():
    rs = build_rewards(
        [
            RewardSpec(name="exact_match"),
            RewardSpec(name="exact_match", extract=r"<a>(.*?)</a>", weight=2.0),
            RewardSpec(name="regex", pattern=r"^<a>.*</a>$", weight=0.5),
            RewardSpec(name="length", target=4),
        ],
        None,
    )
    comps = [" cba ", "<a>cba</a>", "<a>x</a> tail", "nothing"]
    ids = [[1] * 4, [1] * 2, [1] * 8, [1] * 9]
    total, each = score(rs, ["p"] * 4, comps, ids, [{"answer": "cba"}] * 4)
    assert each["exact_match"] == [1.0, 0.0, 0.0, 0.0]
    assert each["exact_match_2"] == [0.0, 1.0, 0.0, 0.0]
    assert each["regex"] == [0.0, 1.0, 0.0, 0.0]
    assert each["length"] == [1.0, 0.5, 0.0, 0.0]
    assert total == [2.0, 3.0, 0.0, 0.0]


def test_a_user_reward_function_gets_every_field(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def fn(prompts, completions, completion_ids, answer, word, **kw):\n"
        "    return [None if w == 'skip' else float(len(c)) for c, w in zip(completions, word)]\n"
    )
    beside = SimpleNamespace(resolve_path=lambda p: tmp_path / p)  # a recipe in tmp_path
    rs = build_rewards([RewardSpec(function="mine.py:fn", weight=0.5)], beside)
    total, each = score(
        rs, ["p", "q"], ["abc", "de"], [[1], [2]], [{"answer": 1, "word": "w"}, {"word": "skip"}]
    )
    assert each["fn"] == [3.0, None] and total == [1.5, 0.0]


@pytest.mark.parametrize(
    "body, message",
    [
        ("    raise ValueError('boom')", "reward function failed: ValueError: boom"),
        ("    return [1.0]", "returned 1 values for"),
        ("    return ['x'] * len(completions)", "expected a finite number or None"),
    ],
)
def test_a_failing_reward_function_is_named_and_exits_2(
    tmp_path, llama_dir, prompts, capsys, body, message
):
    (tmp_path / "bad.py").write_text(
        f"def fn(prompts, completions, completion_ids, **kw):\n{body}\n"
    )
    r = recipe(prompts, llama_dir, {"rewards": [{"function": "bad.py:fn"}]})
    err = refused_run(r, tmp_path, capsys)
    assert "objective.rewards[0] (bad.py:fn)" in err and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "objective, where, message",
    [
        ({"rewards": []}, "objective.rewards", "name at least one"),
        ({"rewards": [{"name": "regex"}]}, "objective.rewards[0]", "needs a 'pattern'"),
        (
            {"rewards": [{"name": "length", "target": 3, "pattern": "x"}]},
            "objective.rewards[0].pattern",
            "does not read 'pattern'",
        ),
        ({"rewards": [{"function": "nope.py:f"}]}, "objective.rewards[0].function", "no such"),
        ({"num_generations": 1}, "objective.num_generations", "no spread"),
        ({"temperature": 0}, "objective.temperature", "greater than 0"),
        ({"micro_batch_size": 0}, "objective.micro_batch_size", "at least 1"),
        ({"loss": "cispo"}, "objective.epsilon_high", "the cap on the importance ratio"),
        ({"loss": "sapo", "sapo_temperature_neg": 0}, "objective.sapo_temperature_neg", "than 0"),
        ({"entropy_mask": 0}, "objective.entropy_mask", "in (0, 1]: the top fraction"),
        ({"entropy_mask": 1.5}, "objective.entropy_mask", "in (0, 1]"),
        ({"importance_sampling_cap": 0}, "objective.importance_sampling_cap", "than 0"),
        ({"filter_max_draws": 0}, "objective.filter_max_draws", "at least 1"),
        ({"max_turns": 0}, "objective.max_turns", "at least 1"),
        ({"tool_timeout_s": 0}, "objective.tool_timeout_s", "greater than 0"),
        ({"tools": ["nope.py:add"]}, "objective.tools[0]", "no such file"),
        # string prompts: a template cannot show tools to a prompt written out
        ({"environment": "nope.py:Env"}, "objective.environment", "no such file"),
    ],
)
def test_bad_grpo_settings_exit_2(tmp_path, llama_dir, prompts, capsys, objective, where, message):
    r = recipe(prompts, llama_dir, objective)
    err = refused_run(r, tmp_path, capsys)
    assert where in err and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "row, message",
    [
        ({"answer": "x"}, "needs a 'prompt'"),
        ({"prompt": 3}, "must be a string or a list"),
        ({"prompt": "reverse ab =", "responses": [" ba"], "rewards": [1]}, "every row of a file"),
        ({"prompt": "reverse ab ="}, "has none"),  # exact_match needs each row's answer
    ],
)
def test_bad_prompt_rows_name_the_line_and_exit_2(
    tmp_path, llama_dir, prompts, capsys, row, message
):
    write_jsonl(tmp_path / "bad.jsonl", [*prompt_rows(3), row])
    r = recipe(prompts, llama_dir, {"rewards": [{"name": "exact_match"}]})
    r["data"] = {**r["data"], "train": str(tmp_path / "bad.jsonl")}
    err = refused_run(r, tmp_path, capsys)
    assert f"{tmp_path / 'bad.jsonl'}:4" in err and message in err and "Traceback" not in err


# ------------------------------------------------------------------------ the run
def test_rows_carry_the_rollout_metrics_and_eval_the_held_out_reward(tmp_path, llama_dir, prompts):
    s = build(recipe(prompts, llama_dir, eval={"every": 3, "at_start": True}), tmp_path).run()
    got = rows(tmp_path / "run")
    train = [x for x in got if "loss" in x]
    assert len(train) == 6
    for k in (
        "reward",
        "reward_std",
        "rewards/length",
        "completion_length",
        "completion_length_max",
        "frac_truncated",
        "clip_ratio",
    ):
        assert all(k in x for x in train), k
    assert all(0 <= x["reward"] <= 1 and x["completion_length_max"] <= 6 for x in train)
    evals = [x for x in got if "eval_reward" in x]
    assert [x["step"] for x in evals] == [0, 3, 6]
    assert all(x["eval_loss"] == -x["eval_reward"] and x["eval_prompts"] == 6 for x in evals)
    assert s["eval_reward_at_start"] == evals[0]["eval_reward"]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {x["step"] for x in samples} == {0, 3, 6} and all("reward" in x for x in samples)


@pytest.mark.parametrize(
    "extra",
    [{}, {"entropy_mask": 0.5}, {"filter_groups": True, "importance_sampling_correction": "token"}],
    ids=["plain", "entropy_mask", "filtered-is"],
)
def test_resume_inside_a_rollout_is_exact(tmp_path, llama_dir, prompts, extra):
    """num_iterations 2 with grad accumulation 2: a rollout trains steps 3 and 4; the run dies
    after step 3's checkpoint and resumes on the same completions and kept log-probs (and
    entropy masks, drawn again from the restored policy)."""
    r = recipe(
        prompts,
        llama_dir,
        {"num_iterations": 2, "beta": 0.05, **extra},
        checkpoints={"every": 3},
    )
    r["train"] = {**r["train"], "grad_accumulation": 2}
    build(r, tmp_path, "whole").run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(r, tmp_path, "crash", callbacks=[make_crash(3)]).run()
    assert (tmp_path / "crash" / "checkpoints" / "step-000003" / "rollout.safetensors").exists()
    build(r, tmp_path, "crash", resume="latest").run()
    whole = rows(tmp_path / "whole")
    assert all(x["kl"] >= 0 for x in whole if "loss" in x)
    assert any(x["kl"] > 0 for x in whole if "loss" in x)  # the policy moved off the reference
    same_rows(rows(tmp_path / "crash"), whole, 0, 0)


def test_offline_groups_train_without_generating(tmp_path, llama_dir):
    d = tmp_path / "off"
    rows_ = [
        {
            "prompt": r["prompt"],
            "responses": [" " + r["answer"], " " + r["word"], " x"],
            "rewards": [1.0, 0.0, 0.2],
        }
        for r in prompt_rows(12, 5)
    ]
    write_jsonl(d / "train.jsonl", rows_)
    write_jsonl(d / "valid.jsonl", rows_[:4])
    r = recipe(d, llama_dir, {"rewards": [], "num_generations": 8})
    t = build(r, tmp_path)
    batch = next(t.objective.batches())[1]
    assert batch.groups == (3, 3, 3)
    a = np.array([1.0, 0.0, 0.2])
    want = (a - a.mean()) / (a.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(batch.advantages, np.tile(want, 3), rtol=1e-5)
    eos = t.tokenizer.eos_token_id
    first = completions(batch)[0]
    prompt = [int(x) for x in batch.tokens[0, : int(batch.lengths[0]) - len(first)]]
    row = next(x for x in rows_ if list(t.tokenizer.encode(x["prompt"])) == prompt)
    whole = list(t.tokenizer.encode(row["prompt"] + row["responses"][0]))
    assert whole[: len(prompt)] == prompt and first == whole[len(prompt) :] + [eos]
    t.run()
    got = rows(tmp_path / "run")
    assert all("generation_s" not in x for x in got)
    evals = [x for x in got if "eval_loss" in x]
    assert len(evals) == 2 and all("eval_reward" not in x for x in evals)  # a loss: no rewards
    targets = sum(b.n_targets for b in t.objective.eval_batches())
    assert [x["eval_tokens"] for x in evals] == [targets, targets]


# ------------------------------------------------------------------------ learning
def quickstart(**over):
    r = shipped_recipe("quickstart-grpo.yaml")
    for k, v in over.items():
        sec, _, key = k.partition(".")
        r[sec][key] = v
    return recipe_from_dict(r)


def copies(adapter_dir, words) -> float:
    """How often mlx-lm's own greedy generation, with the adapter loaded by mlx-lm, copies a
    held-out word."""
    from mlx_lm import generate, load

    model, tok = load(
        str(REPO / "recipes" / "models" / "reverse-tiny"), adapter_path=str(adapter_dir)
    )
    hits = 0
    for w in words:
        out = generate(model, tok, f"copy {w} =", max_tokens=12, verbose=False)
        hits += out.strip() == w
    return hits / len(words)


def offline_copy_groups(path):
    """The preference pairs of quickstart-dpo as offline groups: the copy rewarded 1, the
    reversal 0."""
    src = (REPO / "recipes/data/prefs/train.jsonl").read_text().splitlines()
    out = []
    for x in map(json.loads, src):
        out.append(
            {"prompt": x["prompt"], "responses": [x["chosen"], x["rejected"]], "rewards": [1, 0]}
        )
    write_jsonl(path, out)
    return str(path)


@pytest.mark.parametrize(
    "offline",
    # both under -m slow, for the default run's time (it keeps the losses, resume and rollouts)
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
    ids=["online", "offline"],
)
def test_the_quickstart_learns_to_copy(tmp_path, offline):
    over = {"train.max_steps": 70, "eval.every": 35}
    if offline:  # the given groups; evaluation still generates and scores held-out prompts
        over["data.train"] = offline_copy_groups(tmp_path / "groups.jsonl")
        over["train.batch_size"] = 16
    r = quickstart(**over)
    held = [
        json.loads(x)["answer"]
        for x in (REPO / "recipes/data/copy-prompts/valid.jsonl").read_text().splitlines()
    ][:50]
    before = copies(REPO / "recipes" / "models" / "reverse-tiny-mixed", held)
    assert before < 0.35
    s = Trainer(r, run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    assert s["eval_reward_at_start"] < 0.35 and s["final_eval_reward"] >= 0.8
    assert copies(tmp_path / "run" / "export" / "mlx-lm", held) >= 0.8
    if not offline:  # the completions it draws while training get better too
        train = [x["reward"] for x in rows(tmp_path / "run") if "reward" in x]
        assert np.mean(train[-3:]) > np.mean(train[:2]) + 0.2


def test_stop_strings_end_completions_without_eos(tmp_path, llama_dir, prompts):
    t = build(recipe(prompts, llama_dir, {"stop": ["e"], "max_completion_length": 8}), tmp_path)
    batch = next(t.objective.batches())[1]
    eos, tok = t.tokenizer.eos_token_id, t.tokenizer
    stopped = cut = 0
    for c in completions(batch):
        text = tok.decode([x for x in c if x != eos])
        if "e" in text:  # ends at the token that completes the first "e", no EOS after it
            stopped += 1
            assert c[-1] != eos and "e" in tok.decode(c[-1:]) and "e" not in tok.decode(c[:-1])
        elif c[-1] != eos:
            cut += 1
            assert len(c) == 8
    assert stopped > 0
    host = t.objective.host_metrics(batch)
    assert host["frac_truncated"][0] == cut


PARITY = '''
def parity(prompts, completions, completion_ids, word, **_):
    """Odd-length words: 1 for a completion whose first token is even; even-length words: 0
    whatever the completion (a group without spread)."""
    return [float(len(w) % 2 == 1 and c[0] % 2 == 0) for w, c in zip(word, completion_ids)]
'''


@pytest.mark.parametrize("draws", [1, 4])
def test_group_filtering_keeps_the_groups_with_spread(tmp_path, llama_dir, prompts, draws):
    """filter_groups: the batch holds only groups whose rewards differ, topped up from extra
    draws to batch_size groups (within filter_max_draws); the metrics count what was drawn."""
    (tmp_path / "parity.py").write_text(PARITY)
    rewards = [{"function": str(tmp_path / "parity.py:parity")}]
    obj = {"filter_groups": True, "filter_max_draws": draws, "rewards": rewards}
    t = build(recipe(prompts, llama_dir, obj), tmp_path)
    batch = next(t.objective.batches())[1]
    host = batch.host
    dropped, seen = host["filtered_groups"]
    n = host["filter_draws"][0]
    assert 1 <= n <= draws and seen == 3 * n  # batch_size 3 groups a draw
    starts = np.cumsum([0, *batch.groups])
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        assert np.abs(batch.advantages[a:b]).max() > 0  # every group kept has a spread
    kept = len(batch.groups)
    assert kept == min(3, int(seen - dropped))
    if draws == 1:
        assert dropped > 0 and kept < 3  # the first draw alone falls short
    else:
        assert kept == 3 and n > 1  # topped up from further draws
    # the prompts of the batch: odd-length words only (the even ones never spread)
    tok = t.tokenizer
    for a in starts[:-1]:
        n = int(np.argmax(batch.mask[a] > 0))
        text = tok.decode([int(x) for x in batch.tokens[a, :n]])
        assert len(text.split()[1]) % 2 == 1
