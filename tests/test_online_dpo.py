"""Online DPO (``objective.type: online_dpo``): pairs of the policy's own completions ranked by
rewards recomputed here, the loss against DPO's formula over full logits with a separately loaded
base as the reference (values in float64, gradients in MLX), pairs kept whole by passes and
shares, exact resume, bad settings, and learning the quickstart-grpo task."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import yaml
from test_grpo import (
    build,
    completions,
    copies,
    recipe,
    rows,
    token_logps,
)
from test_preference import logsig, same_gradients, shake_adapters

from conftest import make_crash
from mlxtune import Trainer
from mlxtune.cli import main
from mlxtune.console import Console

ODPO = {"type": "online_dpo", "num_generations": 2, "beta": 0.5}


def odpo_recipe(prompts, llama_dir, **objective):
    r = recipe(prompts, llama_dir, {**ODPO, **objective})
    r["train"]["batch_size"] = 8
    return r


def ranked(batch, eos, penalty):
    """Each pair's (chosen row, rejected row), or None for a tie: the length reward
    (1 - |len - 3| / 3, at least 0) recomputed from the completions, less ``penalty`` for a
    completion without EOS."""
    out = []
    cs = completions(batch)
    for i in range(0, len(cs), 2):
        s = []
        for c in cs[i : i + 2]:
            n = len([x for x in c if x != eos])
            s.append(max(0.0, 1 - abs(n - 3) / 3) - penalty * (c[-1] != eos))
        out.append(None if s[0] == s[1] else ((i, i + 1) if s[0] > s[1] else (i + 1, i)))
    return out


@pytest.mark.parametrize(
    "objective",
    [{"loss": "sigmoid", "missing_eos_penalty": 0.5}, {"loss": "ipo", "beta": 0.4}],
    ids=["sigmoid", "ipo"],
)
def test_the_loss_is_dpo_on_the_ranked_pairs(tmp_path, llama_dir, prompts, objective):
    from mlx_lm import load

    t = build(odpo_recipe(prompts, llama_dir, **objective), tmp_path)
    o, obj = t.recipe.objective, t.objective
    batch = obj.rollout(0)[0]
    shake_adapters(t.model)  # the policy now differs from the reference
    pairs = ranked(batch, t.tokenizer.eos_token_id, o.missing_eos_penalty)
    kept = [p for p in pairs if p is not None]
    if o.missing_eos_penalty:  # the penalty changes the ranking of some pair here
        assert pairs != ranked(batch, t.tokenizer.eos_token_id, 0.0)
    assert kept and obj.count(batch) == len(kept)
    base, _ = load(str(llama_dir))  # the reference (LoRA, auto): the base loaded on its own

    def seq(model, i):
        """(log-prob of row i's completion, its token count), the model's full logits."""
        n = int(batch.lengths[i])
        where = [j for j in range(n - 1) if batch.mask[i, j + 1]]
        lp = token_logps(model, [int(x) for x in batch.tokens[i, :n]])[mx.array(where)]
        return mx.sum(lp), len(where)

    ref = {i: float(seq(base, i)[0]) for p in kept for i in p}

    def margin(model, c, r):
        (pc, nc), (pr, nr) = seq(model, c), seq(model, r)
        qc, qr = ref[c], ref[r]
        if o.loss == "ipo":
            pc, pr, qc, qr = pc / nc, pr / nr, qc / nc, qr / nr
        return (pc - qc) - (pr - qr)

    want = 0.0
    for c, r in kept:  # float64 from the model's logits
        h = float(margin(t.model, c, r))
        want += -logsig(o.beta * h) if o.loss == "sigmoid" else (h - 1 / (2 * o.beta)) ** 2
    arrays = t.engine.arrays(batch)
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(kept)
    assert loss.item() == pytest.approx(want, rel=2e-5, abs=1e-5)
    hs = [float(margin(t.model, c, r)) for c, r in kept]
    assert metrics["rewards/accuracies"].item() == sum(h > 0 for h in hs)

    def naive(model):
        total = 0.0
        for c, r in kept:
            h = margin(model, c, r)
            b = o.beta
            total = total + (
                mx.logaddexp(0.0, -b * h) if o.loss == "sigmoid" else mx.square(h - 1 / (2 * b))
            )
        return total

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])


def test_passes_and_shares_keep_pairs_whole(tmp_path, llama_dir, prompts):
    t = build(odpo_recipe(prompts, llama_dir, micro_batch_size=4), tmp_path)
    obj = t.objective
    batch = obj.rollout(0)[0]
    whole = obj.loss(t.model, t.engine.arrays(batch))[0].item()
    for parts in (obj.micro(batch), obj.split(batch, 3), obj.split(batch, 16)):
        assert all(len(p.tokens) % 2 == 0 and set(p.groups) == {2} for p in parts)
        assert sum(obj.count(p) for p in parts) == obj.count(batch)
        got = sum(obj.loss(t.model, t.engine.arrays(p))[0].item() for p in parts)
        assert got == pytest.approx(whole, rel=1e-5, abs=1e-6)
    assert len(obj.micro(batch)) == 4  # 16 completions, 4 a pass
    nothing = obj.nothing(batch)
    assert obj.count(nothing) == 0 and obj.loss(t.model, t.engine.arrays(nothing))[0].item() == 0


def test_a_run_logs_pairs_evaluates_rewards_and_resumes_exactly(tmp_path, llama_dir, prompts):
    r = odpo_recipe(prompts, llama_dir)
    r["train"]["max_steps"] = 4
    r["eval"] = {"every": 2}
    r["checkpoints"] = {"every": 2}
    build(r, tmp_path, "whole").run()
    want = rows(tmp_path / "whole")
    steps = [x for x in want if "loss" in x]
    assert len(steps) == 4
    assert all("rewards/margins" in x and "frac_ties" in x and "kl" in x for x in steps)
    assert any("eval_reward" in x for x in want)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(r, tmp_path, "cut", callbacks=[make_crash(2)]).run()
    build(r, tmp_path, "cut", resume="latest").run()
    assert rows(tmp_path / "cut") == want


@pytest.mark.parametrize(
    "objective, key, message",
    [
        ({"num_generations": 4}, "objective.num_generations", "2 (a pair a prompt)"),
        ({"beta": 0.0}, "objective.beta", "greater than 0"),
        ({"missing_eos_penalty": -1.0}, "objective.missing_eos_penalty", "at least 0"),
        ({"epsilon": 0.2}, "objective.epsilon", "unknown key"),
    ],
)
def test_bad_online_dpo_settings_exit_2(
    tmp_path, llama_dir, prompts, capsys, objective, key, message
):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(odpo_recipe(prompts, llama_dir, **objective)))
    assert main(["run", str(tmp_path / "r.yaml"), "--run-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert key in err and message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_the_quickstart_learns_to_copy(tmp_path):
    """recipes/quickstart-online-dpo.yaml: quickstart-grpo's task (copy the word) from pairs."""
    from conftest import REPO, shipped_recipe
    from mlxtune import recipe_from_dict

    r = shipped_recipe("quickstart-online-dpo.yaml")
    held = [
        json.loads(x)["answer"]
        for x in (REPO / "recipes/data/copy-prompts/valid.jsonl").read_text().splitlines()
    ][:50]
    s = Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    assert s["eval_reward_at_start"] < 0.35 and s["final_eval_reward"] >= 0.9, s
    assert copies(tmp_path / "run" / "export" / "mlx-lm", held) >= 0.9
    ties = [x["frac_ties"] for x in rows(tmp_path / "run") if "frac_ties" in x]
    assert ties[-1] > ties[0]  # once it copies every time, both completions of a pair score 1
