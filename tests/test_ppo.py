"""PPO: advantages and returns against GAE's closed form over rewards rebuilt here (the policy's
and a separately loaded base's log-probs over full logits, the value head applied by hand), the
loss against its formula (values and gradients, the value head's too), exact resume inside a
rollout with an adaptive KL coefficient, a reward model's scores, exports without the value head,
bad settings, and learning on the shipped quickstart-ppo task."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten
from test_grpo import completions, rows, token_logps
from test_preference import pair_rows, shake_adapters

from conftest import (
    REPO,
    make_crash,
    objective_recipe,
    refused_run,
    same_gradients,
    same_rows,
    shipped_recipe,
    write_jsonl,
    write_splits,
)
from conftest import build_run as build
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console

PATTERN = "^.?[aeo]"  # rewards with spread on a random model's completions


def recipe(prompts, model_dir, objective=None, **over):
    obj = {
        "type": "ppo",
        "num_generations": 2,
        "max_completion_length": 6,
        "ppo_epochs": 2,
        "num_mini_batches": 2,
        "rewards": [{"name": "regex", "pattern": PATTERN}],
    }
    obj.update(objective or {})
    return objective_recipe(
        "ppo",
        model_dir,
        prompts,
        obj,
        max_length=24,
        batch_size=4,
        max_steps=8,
        eval_every=4,
        **over,
    )


def shake_value_head(model, seed=1):
    rng = np.random.default_rng(seed)
    head = model.value_head
    head.weight = mx.array(rng.normal(0, 0.5, head.weight.shape).astype(np.float32))
    head.bias = mx.array([0.3], dtype=mx.float32)


def targets(batch, i):
    """Row i's target positions (into the L-1 positions the model reads)."""
    return [j for j in range(int(batch.lengths[i]) - 1) if batch.mask[i, j + 1]]


def test_advantages_and_returns_are_gae_of_the_kl_shaped_rewards(tmp_path, llama_dir, prompts):
    from mlx_lm import load

    cfg = {"kl_coef": 0.2, "gamma": 0.9, "lam": 0.8, "whiten_advantages": False}
    cfg.update(kl_target=0.08, kl_horizon=10)  # the coefficient adapts after the rollout
    t = build(recipe(prompts, llama_dir, cfg), tmp_path)
    shake_adapters(t.model)  # the policy differs from its reference, the base
    shake_value_head(t.model)
    base, _ = load(str(llama_dir))
    batch = t.objective.rollout(0)[0]
    tok, eos = t.tokenizer, t.tokenizer.eos_token_id
    w = np.array(t.model.value_head.weight, np.float64)[0]
    b = float(t.model.value_head.bias[0])
    kls = []
    for i, comp in enumerate(completions(batch)):
        ids = [int(x) for x in batch.tokens[i, : int(batch.lengths[i])]]
        where = targets(batch, i)
        logp = np.array(token_logps(t.model, ids), np.float64)[where]
        ref = np.array(token_logps(base, ids), np.float64)[where]
        hidden = np.array(t.model.model(mx.array([ids[:-1]]))[0], np.float64)[where]
        values = hidden @ w + b
        # what a reward function reads: the completion's text without EOS or special tokens
        text = tok.decode([x for x in comp if x != eos], skip_special_tokens=True)
        score = float(re.search(PATTERN, text, re.DOTALL) is not None)
        kls.append((logp - ref).sum())
        r = -0.2 * (logp - ref)
        r[-1] += score
        nxt = np.append(values[1:], 0.0)
        delta = r + 0.9 * nxt - values
        # GAE's closed form: A_t = sum over l of (gamma lam)^l delta_{t+l}
        want = np.array(
            [
                sum((0.9 * 0.8) ** k * delta[s + k] for k in range(len(delta) - s))
                for s in range(len(delta))
            ]
        )
        np.testing.assert_allclose(batch.token_advantages[i, where], want, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(batch.returns[i, where], want + values, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(batch.values[i, where], values, rtol=1e-4, atol=1e-5)
        off = np.ones(batch.mask.shape[1] - 1, bool)
        off[where] = False
        assert not batch.token_advantages[i, off].any()
    # kl: per completion, summed over its tokens; Ziegler et al.'s controller then moves the
    # coefficient by clip(kl / target - 1, +-0.2) x completions / horizon
    kl = np.mean(kls)
    host = t.objective.host_metrics(batch)
    assert host["kl"][0] / host["kl"][1] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    err = np.clip(kl / 0.08 - 1, -0.2, 0.2)
    assert abs(err) < 0.2  # inside the clip, where a wrong ratio would show
    assert t.objective.kl_coef == pytest.approx(0.2 * (1 + err * len(kls) / 10), rel=1e-4)
    # whitened: mean 0 and standard deviation 1 over the rollout's completion tokens
    t2 = build(recipe(prompts, llama_dir, {"kl_coef": 0.2}), tmp_path, "whitened")
    shake_adapters(t2.model)
    b2 = t2.objective.rollout(0)[0]
    a = b2.token_advantages[b2.mask[:, 1:] > 0].astype(np.float64)
    assert abs(a.mean()) < 1e-5 and a.std(ddof=1) == pytest.approx(1.0, rel=1e-4)


def naive_ppo(model, batch, c, cv, vf_coef, ent_coef):
    """The PPO loss written out completion by completion over full logits."""
    total, n = 0.0, 0
    for i in range(len(batch.tokens)):
        ids = [int(x) for x in batch.tokens[i, : int(batch.lengths[i])]]
        where = mx.array(targets(batch, i))
        logits = model(mx.array([ids[:-1]]))[0].astype(mx.float32)
        logp_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lp = mx.take_along_axis(logp_all, mx.array(ids[1:])[:, None], axis=-1)[:, 0][where]
        h = model.model(mx.array([ids[:-1]]))[0].astype(mx.float32)[where]
        v = (h @ model.value_head.weight.T)[:, 0] + model.value_head.bias
        old = mx.array(batch.old[i])[where]
        a = mx.array(batch.token_advantages[i])[where]
        v_old, ret = mx.array(batch.values[i])[where], mx.array(batch.returns[i])[where]
        ratio = mx.exp(lp - old)
        pg = mx.maximum(-a * ratio, -a * mx.clip(ratio, 1 - c, 1 + c))
        vc = v_old + mx.clip(v - v_old, -cv, cv)
        vf = 0.5 * mx.maximum(mx.square(v - ret), mx.square(vc - ret))
        p = mx.exp(logp_all[where])
        ent = -mx.sum(p * logp_all[where], axis=-1)
        total = total + mx.sum(pg + vf_coef * vf - ent_coef * ent)
        n += len(targets(batch, i))
    return total / n


def test_the_loss_is_its_formula_in_values_and_gradients(tmp_path, llama_dir, prompts):
    cfg = {"cliprange": 0.2, "cliprange_value": 0.1, "vf_coef": 0.3, "entropy_coef": 0.05}
    t = build(recipe(prompts, llama_dir, cfg), tmp_path)
    shake_adapters(t.model)
    shake_value_head(t.model)
    obj = t.objective
    batch = next(obj.batches())[1]
    rng = np.random.default_rng(0)
    shape = batch.mask[:, 1:].shape
    batch.old = (batch.old + rng.choice([-0.5, -0.05, 0.05, 0.5], shape)).astype(np.float32)
    batch.token_advantages = rng.normal(0, 1, shape).astype(np.float32)
    batch.values = (batch.values + rng.normal(0, 0.3, shape)).astype(np.float32)
    batch.returns = rng.normal(0, 1, shape).astype(np.float32)
    arrays = t.engine.arrays(batch)
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == batch.n_targets == obj.count(batch)
    want = naive_ppo(t.model, batch, 0.2, 0.1, 0.3, 0.05)
    assert loss.item() / count.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-6)
    assert metrics["clip_ratio"].item() > 0 and metrics["value_clip_ratio"].item() > 0
    n = count.item()
    want_g = same_gradients(
        t.model,
        lambda m: naive_ppo(m, batch, 0.2, 0.1, 0.3, 0.05),
        lambda m: obj.loss(m, arrays)[0] / n,
        rtol=5e-4,
        atol=5e-6,
    )
    assert "value_head.weight" in want_g


def test_resume_inside_a_rollout_is_exact_and_exports_leave_the_value_head(
    tmp_path, llama_dir, prompts
):
    from mlx_lm import load

    r = recipe(
        prompts,
        llama_dir,
        {"kl_coef": 0.1, "kl_target": 0.5, "kl_horizon": 20, "reference": "copy"},
        checkpoints={"every": 2},
        export={"formats": ["mlx-lm", "peft"]},
    )
    build(r, tmp_path, "whole").run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(r, tmp_path, "crash", callbacks=[make_crash(2)]).run()
    ckpt = tmp_path / "crash" / "checkpoints" / "step-000002"
    assert (ckpt / "rollout.safetensors").exists() and (ckpt / "value_head.safetensors").exists()
    build(r, tmp_path, "crash", resume="latest").run()
    whole = rows(tmp_path / "whole")
    coefs = [x["kl_coef"] for x in whole if "kl_coef" in x]  # a row a rollout: steps 1, 5
    assert coefs[0] == 0.1 and coefs[-1] != 0.1  # the coefficient adapted
    assert {"policy_loss", "value_loss", "explained_variance", "kl"} <= whole[0].keys()
    same_rows(rows(tmp_path / "crash"), whole, 0, 0)
    # the exports hold the policy alone: mlx-lm loads the adapter strictly
    out = tmp_path / "whole" / "export"
    assert not (out / "mlx-lm" / "value_head.safetensors").exists()
    model, _ = load(str(llama_dir), adapter_path=str(out / "mlx-lm"))
    assert "value_head" not in dict(tree_flatten(model.parameters()))
    assert main(["export", str(tmp_path / "whole"), "--format", "fused"]) == 0


def test_a_reward_model_scores_the_completions(tmp_path, llama_dir, prompts):
    from mlxtune.runs.checkpoint import load_trained

    d = write_splits(tmp_path / "prefs", pair_rows, 12, 4)
    rm = recipe(prompts, llama_dir, {}, train={"batch_size": 4, "max_steps": 2, "progress": False})
    rm["objective"] = {"type": "reward"}
    rm["data"] = {"train": str(d / "train.jsonl"), "valid": str(d / "valid.jsonl")}
    build(rm, tmp_path, "rm").run()
    r = recipe(prompts, llama_dir, {"rewards": [], "reward_model": str(tmp_path / "rm")})
    t = build(r, tmp_path)
    batch = t.objective.rollout(0)[0]
    scorer = load_trained(tmp_path / "rm").model
    eos = t.tokenizer.eos_token_id
    want = []
    for i, comp in enumerate(completions(batch)):
        ids = [int(x) for x in batch.tokens[i, : int(batch.lengths[i])]]
        if comp[-1] != eos:
            ids.append(eos)  # as the reward model was trained: the sequence ends with EOS
        h = scorer.model(mx.array([ids]))[0, -1]
        want.append(float(scorer.score(h.astype(mx.float32))[0]))
    host = t.objective.host_metrics(batch)
    assert host["rewards/reward_model"][0] / host["rewards/reward_model"][1] == pytest.approx(
        np.mean(want), rel=1e-4, abs=1e-6
    )
    t.run()
    evals = [x for x in rows(tmp_path / "run") if "eval_reward" in x]
    assert evals and all("eval_rewards/reward_model" in x for x in evals)


@pytest.mark.parametrize(
    "objective, where, message",
    [
        ({"reward_model": "nowhere"}, "objective.reward_model", "no such run"),
        ({"kl_coef": 0.0, "kl_target": 1.0}, "objective.kl_coef", "above 0 to adapt"),
        ({"lam": 1.5}, "objective.lam", "in [0, 1]"),
        ({"rewards": []}, "objective.rewards", "name at least one"),
    ],
)
def test_bad_ppo_settings_exit_2(tmp_path, llama_dir, prompts, capsys, objective, where, message):
    r = recipe(prompts, llama_dir, objective)
    err = refused_run(r, tmp_path, capsys)
    assert where in err and message in err and "Traceback" not in err


def test_packing_is_refused_in_ppos_words(tmp_path, llama_dir, prompts, capsys):
    r = recipe(prompts, llama_dir)
    r["data"]["packing"] = "pack"
    err = refused_run(r, tmp_path, capsys)
    assert "data.packing" in err and "objective.type ppo trains on generated completions" in err, (
        err
    )


def test_offline_rows_are_refused(tmp_path, llama_dir, capsys):
    d = tmp_path / "off"
    rows_ = [{"prompt": "reverse ab =", "responses": [" ba"], "rewards": [1]}] * 4
    write_jsonl(d / "train.jsonl", rows_)
    write_jsonl(d / "valid.jsonl", rows_)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe(d, llama_dir)))
    assert main(["run", str(tmp_path / "r.yaml"), "--run-dir", str(tmp_path / "out")]) == 2
    assert "train with objective.type grpo" in capsys.readouterr().err


@pytest.mark.slow
def test_the_quickstart_learns_to_copy(tmp_path):
    from test_grpo import copies

    r = shipped_recipe("quickstart-ppo.yaml")
    s = Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    assert s["eval_reward_at_start"] < 0.35 and s["final_eval_reward"] >= 0.7
    held = [
        json.loads(x)["answer"]
        for x in (REPO / "recipes/data/copy-prompts/valid.jsonl").read_text().splitlines()
    ][:50]
    assert copies(tmp_path / "run" / "export" / "mlx-lm", held) >= 0.7


def test_validate_and_dry_run_describe_rl_runs(tmp_path, llama_dir, prompts, capsys):
    r = recipe(prompts, llama_dir)
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(r))
    assert main(["run", str(tmp_path / "ppo.yaml"), "--dry-run"]) == 0
    got = capsys.readouterr()
    out = got.out + got.err
    assert "rollouts of 4 prompts x 2 completions, each trained 2 epochs x 2 minibatches" in out
    assert "objective ppo" in out and "dry run: one step compiled" in out
    r["objective"] = {"type": "grpo", "num_generations": 3, "rewards": r["objective"]["rewards"]}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(r))
    assert main(["run", str(tmp_path / "grpo.yaml"), "--dry-run"]) == 0
    got = capsys.readouterr()
    assert "4 prompts x 3 completions/step" in got.out + got.err
