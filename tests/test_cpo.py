"""CPO and SimPO (``objective.type: cpo``): each loss against its paper's formula written here over
full logits (values in float64, gradients in MLX), bad settings, and learning the quickstart's
preference with no reference policy."""

from __future__ import annotations

import json

import pytest
from test_preference import (
    batch_pairs,
    build,
    logsig,
    pair_logps,
    pair_rows,
    preference_accuracy,
    quickstart,
    recipe,
    same_gradients,
    shake_adapters,
)

from conftest import REPO, mx_logp, mx_pair_loss, refused_run, write_jsonl
from mlxtune import Trainer
from mlxtune.console import Console


@pytest.fixture
def pair_data(tmp_path):
    """test_preference's pairs: "reverse w =" preferring the reversal."""
    write_jsonl(tmp_path / "prefs" / "train.jsonl", pair_rows(48, 1))
    write_jsonl(tmp_path / "prefs" / "valid.jsonl", pair_rows(10, 2))
    return tmp_path / "prefs"


def cpo_formula(kind, beta, eps, alpha, gamma, pc, pr, nc, nr):
    """A pair's loss from the CPO (Xu et al.) and SimPO (Meng et al.) papers, numpy float64:
    ``pc``/``pr`` the summed log-probs, ``nc``/``nr`` the completions' token counts."""
    if kind in ("simpo", "ipo"):
        z = pc / nc - pr / nr  # length-normalised
    else:
        z = pc - pr
    if kind == "sigmoid":
        loss = -(1 - eps) * logsig(beta * z) - eps * logsig(-beta * z)
    elif kind == "simpo":  # -log sigmoid(beta/|yw| log pi(yw) - beta/|yl| log pi(yl) - gamma)
        m = beta * z - gamma
        loss = -(1 - eps) * logsig(m) - eps * logsig(-m)
    elif kind == "hinge":
        loss = max(0.0, 1 - beta * z)
    else:
        loss = (z - 1 / (2 * beta)) ** 2
    return loss + alpha * (-pc / nc)


@pytest.mark.parametrize(
    "objective",
    [
        {"type": "cpo", "beta": 0.5},
        {"type": "cpo", "beta": 0.3, "label_smoothing": 0.2, "cpo_alpha": 0.5},
        {"type": "cpo", "loss": "simpo", "beta": 2.0, "simpo_gamma": 0.8, "cpo_alpha": 0.0},
        {"type": "cpo", "loss": "simpo", "beta": 2.5, "label_smoothing": 0.1, "cpo_alpha": 0.3},
        {"type": "cpo", "loss": "hinge", "beta": 0.4},
        {"type": "cpo", "loss": "ipo", "beta": 0.2, "cpo_alpha": 0.0},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_each_cpo_loss_is_its_formula_in_values_and_gradients(
    tmp_path,
    llama_dir,
    pair_data,
    objective,
):
    t = build(recipe(pair_data, llama_dir, objective), tmp_path)
    shake_adapters(t.model)
    obj, o = t.objective, t.recipe.objective
    batch = next(obj.batches())[1]
    arrays = t.engine.arrays(batch)
    pairs = batch_pairs(t, batch)
    pol = pair_logps(t.model, pairs)
    lens = [(p.n_targets, p.rejected_targets) for p in pairs]
    args = (o.loss, o.beta, o.label_smoothing, o.cpo_alpha, o.simpo_gamma)
    want = [cpo_formula(*args, *pp, *nn_) for pp, nn_ in zip(pol, lens, strict=True)]
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(pairs) == obj.count(batch)
    assert loss.item() == pytest.approx(sum(want), rel=2e-5, abs=1e-5)
    norm = o.loss in ("simpo", "ipo")
    chosen = [o.beta * (p[0] / n[0] if norm else p[0]) for p, n in zip(pol, lens, strict=True)]
    rejected = [o.beta * (p[1] / n[1] if norm else p[1]) for p, n in zip(pol, lens, strict=True)]
    assert metrics["rewards/chosen"].item() == pytest.approx(sum(chosen), rel=1e-4, abs=1e-5)
    assert metrics["rewards/accuracies"].item() == sum(
        c > r for c, r in zip(chosen, rejected, strict=True)
    )
    assert ("nll_loss" in metrics) == (o.cpo_alpha > 0)
    # logps/*: the log-probs the loss compares, averaged over the answer's tokens under simpo
    # and ipo (as TRL's CPOTrainer reports them), so the name means one thing
    for k, i in (("logps/chosen", 0), ("logps/rejected", 1)):
        want_logps = sum(p[i] / n[i] if norm else p[i] for p, n in zip(pol, lens, strict=True))
        assert metrics[k].item() == pytest.approx(want_logps, rel=1e-4, abs=1e-5), k

    def naive(model):  # the formula in MLX over full logits
        total = 0.0
        for p, (nc, nr) in zip(pairs, lens, strict=True):
            pc, pr = mx_logp(model, p.ids, p.mask), mx_logp(model, p.rejected_ids, p.rejected_mask)
            z = pc / nc - pr / nr if norm else pc - pr
            simpo = o.loss == "simpo"  # the sigmoid loss, its logit less a margin
            kind, shift = ("sigmoid", o.simpo_gamma) if simpo else (o.loss, 0.0)
            loss = mx_pair_loss(kind, z, o.beta, o.label_smoothing, shift)
            total = total + loss + o.cpo_alpha * (-pc / nc)
        return total

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])


@pytest.mark.parametrize(
    "objective, key, message",
    [
        ({"beta": 0.0}, "objective.beta", "greater than 0"),
        ({"cpo_alpha": -1.0}, "objective.cpo_alpha", "at least 0"),
        (
            {"loss": "hinge", "label_smoothing": 0.1},
            "objective.label_smoothing",
            "0 with loss hinge",
        ),
        ({"label_smoothing": 0.5}, "objective.label_smoothing", "in [0, 0.5)"),
        ({"reference": "copy"}, "objective.reference", "unknown key"),
    ],
)
def test_bad_cpo_settings_exit_2(
    tmp_path,
    llama_dir,
    pair_data,
    capsys,
    objective,
    key,
    message,
):
    r = recipe(pair_data, llama_dir, {"type": "cpo", **objective})
    err = refused_run(r, tmp_path, capsys)
    assert key in err and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_simpo_gamma_is_noted_outside_simpo(tmp_path, capsys):
    from test_recipe import recipe_text, validate_notes

    text = recipe_text(objective={"type": "cpo", "loss": "sigmoid", "simpo_gamma": 1.0})
    assert "objective.simpo_gamma" in validate_notes(tmp_path, capsys, text)
    text = recipe_text(objective={"type": "cpo", "loss": "simpo", "simpo_gamma": 1.0})
    assert "objective.simpo_gamma" not in validate_notes(tmp_path, capsys, text)


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective",
    [
        {"type": "cpo", "beta": 0.1, "cpo_alpha": 1.0},
        {"type": "cpo", "loss": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
    ],
    ids=["cpo", "simpo"],
)
def test_the_quickstart_learns_the_preferred_answer_without_a_reference(tmp_path, objective):
    r = quickstart(objective)
    held = [
        json.loads(x) for x in (REPO / "recipes/data/prefs/valid.jsonl").read_text().splitlines()
    ]
    Trainer(r, run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    assert preference_accuracy(tmp_path / "run" / "export" / "mlx-lm", held) >= 0.9
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "reference" not in log.lower()  # no reference policy kept or run
