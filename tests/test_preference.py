"""Preference objectives (DPO and its losses, ORPO): pairs encoded with only completion tokens
scored, each loss against its paper's formula written here over full logits (values in float64,
gradients in MLX), the reference policies against a separately loaded base, pairs kept whole by
every split, exact resume, bad input, and learning on the shipped quickstart-dpo task."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import (
    LETTERS,
    REPO,
    make_crash,
    mx_logp,
    mx_pair_loss,
    naive_logp,
    objective_recipe,
    refused_run,
    same_gradients,
    same_rows,
    shake_adapters,
    shipped_recipe,
    write_jsonl,
    write_splits,
)
from conftest import build_run as build
from conftest import run_rows as rows
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.data.preference import make_packed_pair_batch, make_pair_batch
from mlxtune.models import kernel_attention

CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def pair_rows(n, seed=0):
    """ "reverse w =" pairs preferring the reversal to the word itself, of mixed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w = "".join(rng.choice(list(LETTERS), rng.integers(3, 8)))
        out.append({"prompt": f"reverse {w} =", "chosen": f" {w[::-1]}", "rejected": f" {w}"})
    return out


@pytest.fixture
def prefs(tmp_path):
    return write_splits(tmp_path / "prefs", pair_rows, 48, 10)


def recipe(prefs, model_dir, objective=None, **over):
    return objective_recipe(
        "pref", model_dir, prefs, objective or {"type": "dpo", "beta": 0.5}, **over
    )


def same(a, b, rel=1e-5, abs=1e-6):
    same_rows(a, b, rel, abs)


# ------------------------------------------------------------------------ naive references
def logsig(x):
    return -np.logaddexp(0, -x)


def dpo_formula(kind, beta, eps, pc, pr, rc, rr, nc, nr, rpo=0.0):
    """A pair's loss, from the DPO, IPO and robust-DPO papers' formulas (numpy float64)."""
    if kind == "ipo":
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    h = (pc - rc) - (pr - rr)
    if kind == "sigmoid":
        loss = -(1 - eps) * logsig(beta * h) - eps * logsig(-beta * h)
    elif kind == "robust":
        loss = (-(1 - eps) * logsig(beta * h) + eps * logsig(-beta * h)) / (1 - 2 * eps)
    elif kind == "hinge":
        loss = max(0.0, 1 - beta * h)
    else:
        loss = (h - 1 / (2 * beta)) ** 2
    nll = -pc if kind == "ipo" else -pc / nc
    return loss + rpo * nll


def orpo_formula(beta, pc, pr, nc, nr, nll=None):
    """ORPO (Hong et al.): mean NLL of the chosen + beta * -log sigmoid(log odds ratio);
    ``nll``: another NLL term (TRL's, over whole sequences)."""
    ac, ar = pc / nc, pr / nr
    log_odds = (ac - ar) - (np.log1p(-np.exp(ac)) - np.log1p(-np.exp(ar)))
    return (-ac if nll is None else nll) - beta * logsig(log_odds)


def whole_nll(model, pairs, logp) -> tuple:
    """TRL's ORPO NLL: -(log-prob of every token of the chosen sequences after their first) /
    (how many there are), the prompt included."""
    got = [logp(model, p.ids, [1] * len(p.ids)) for p in pairs]
    return -sum(got) / sum(len(p.ids) - 1 for p in pairs)


def batch_pairs(trainer, batch):
    return [trainer.train_set.examples[i] for i in batch.pairs if i >= 0]


def pair_logps(model, pairs) -> list[tuple]:
    """Each pair's (chosen, rejected) completion log-probs in float64 (``naive_logp``)."""
    return [
        (naive_logp(model, p.ids, p.mask), naive_logp(model, p.rejected_ids, p.rejected_mask))
        for p in pairs
    ]


# ------------------------------------------------------------------------ data
def test_pairs_score_only_their_completions(tmp_path, llama_dir, prefs, tokenizer):
    t = build(recipe(prefs, llama_dir), tmp_path)
    for p in t.train_set.examples:
        for ids, mask in ((p.ids, p.mask), (p.rejected_ids, p.rejected_mask)):
            first = mask.index(1)
            assert ids[:first] == p.prompt_ids  # the prompt, unscored
            assert all(mask[first:])  # the completion and EOS, scored
            assert ids[-1] == tokenizer.eos_token_id
    # chat pairs, explicit and implicit prompts: only the final assistant turn is scored
    user = [{"role": "user", "content": "reverse abc ="}]
    ans = lambda s: [{"role": "assistant", "content": s}]  # noqa: E731
    prior = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    write_jsonl(
        tmp_path / "chat" / "train.jsonl",
        [
            {"prompt": prior + user, "chosen": ans("cba"), "rejected": ans("abc")},
            {"chosen": prior + user + ans("cba"), "rejected": prior + user + ans("abc")},
        ],
    )
    r = recipe(prefs, llama_dir, tokenizer={"chat_template": CHAT})
    r["data"] = {**r["data"], "train": str(tmp_path / "chat" / "train.jsonl")}
    t = build(r, tmp_path, "chat")
    a, b = t.train_set.examples
    assert (a.ids, a.mask, a.rejected_ids, a.rejected_mask) == (
        b.ids,
        b.mask,
        b.rejected_ids,
        b.rejected_mask,
    )
    text = t.tokenizer.decode([i for i, m in zip(a.ids, a.mask, strict=True) if m])
    assert text.strip() == "cba"  # not the earlier "ok"
    assert a.answer == "cba"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "reverse ab =", "rejected": " ab"}, "missing field 'chosen'"),
        (
            {"prompt": "reverse ab =", "chosen": "  ", "rejected": " ab"},
            "'chosen' completion is empty",
        ),
        (
            {"prompt": "reverse " + "ab" * 40 + " =", "chosen": " a", "rejected": " b"},
            "prompt alone",
        ),
        ({"prompt": "reverse ab =", "chosen": " ba", "rejected": 3}, "'rejected' must be a string"),
    ],
)
def test_bad_pairs_name_the_line_and_exit_2(tmp_path, llama_dir, prefs, capsys, row, message):

    write_jsonl(tmp_path / "bad.jsonl", [*pair_rows(3), row])
    r = recipe(prefs, llama_dir)
    r["data"] = {**r["data"], "train": str(tmp_path / "bad.jsonl")}
    err = refused_run(r, tmp_path, capsys)
    assert f"{tmp_path / 'bad.jsonl'}:4" in err and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_sft_refuses_pairs_and_preference_objectives_refuse_other_data(
    tmp_path, llama_dir, prefs, data_dir, capsys
):
    import yaml

    r = recipe(prefs, llama_dir, objective={"type": "sft"})
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(r))
    assert main(["validate", str(tmp_path / "a.yaml")]) in (0, 2)  # validate reads no data
    assert main(["run", str(tmp_path / "a.yaml"), "--run-dir", str(tmp_path / "a")]) == 2
    assert "objective.type dpo, orpo, cpo or reward" in capsys.readouterr().err
    r = recipe(prefs, llama_dir)
    r["data"] = {**r["data"], "train": str(data_dir / "train.jsonl"), "valid": None}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(r))
    assert main(["run", str(tmp_path / "b.yaml"), "--run-dir", str(tmp_path / "b")]) == 2
    assert "train on pairs" in capsys.readouterr().err


# ------------------------------------------------------------------------ losses
@pytest.mark.parametrize(
    "objective",
    [
        {"type": "dpo", "beta": 0.5, "loss": "sigmoid"},
        {"type": "dpo", "beta": 0.3, "loss": "sigmoid", "label_smoothing": 0.2},
        {"type": "dpo", "beta": 0.3, "loss": "robust", "label_smoothing": 0.1},
        {"type": "dpo", "beta": 0.4, "loss": "hinge"},
        {"type": "dpo", "beta": 0.2, "loss": "ipo"},
        {"type": "dpo", "beta": 0.5, "rpo_alpha": 0.7},
        {"type": "orpo", "beta": 0.4},
        {"type": "orpo", "beta": 0.4, "nll_over": "sequence"},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_each_loss_is_its_formula_in_values_and_gradients(tmp_path, llama_dir, prefs, objective):
    from mlx_lm import load

    t = build(recipe(prefs, llama_dir, objective), tmp_path)
    shake_adapters(t.model)
    base, _ = load(str(llama_dir))  # the reference: a base model loaded on its own
    obj = t.objective
    batch = next(obj.batches())[1]
    arrays = t.engine.arrays(batch)
    pairs = batch_pairs(t, batch)
    pol, ref = pair_logps(t.model, pairs), pair_logps(base, pairs)
    lens = [(p.n_targets, p.rejected_targets) for p in pairs]
    o = t.recipe.objective
    if o.type == "dpo":
        want = [
            dpo_formula(o.loss, o.beta, o.label_smoothing, *pp, *rr, *nn_, o.rpo_alpha)
            for pp, rr, nn_ in zip(pol, ref, lens, strict=True)
        ]
    else:
        nll = whole_nll(t.model, pairs, naive_logp) if o.nll_over == "sequence" else None
        want = [orpo_formula(o.beta, *pp, *nn_, nll) for pp, nn_ in zip(pol, lens, strict=True)]
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(pairs) == obj.count(batch)
    assert loss.item() == pytest.approx(sum(want), rel=2e-5, abs=1e-5)
    if o.type == "dpo" and o.loss != "ipo":
        chosen = [o.beta * (p[0] - r[0]) for p, r in zip(pol, ref, strict=True)]
        rejected = [o.beta * (p[1] - r[1]) for p, r in zip(pol, ref, strict=True)]
        assert metrics["rewards/chosen"].item() == pytest.approx(sum(chosen), rel=1e-4, abs=1e-5)
        assert metrics["rewards/margins"].item() == pytest.approx(
            sum(chosen) - sum(rejected), rel=1e-4, abs=1e-5
        )
        assert metrics["rewards/accuracies"].item() == sum(
            c > r for c, r in zip(chosen, rejected, strict=True)
        )
        assert metrics["logps/rejected"].item() == pytest.approx(sum(p[1] for p in pol), rel=1e-5)
    if o.type == "orpo":  # from the log-probs averaged over each completion's tokens
        ac = np.array([p[0] / n[0] for p, n in zip(pol, lens, strict=True)])
        ar = np.array([p[1] / n[1] for p, n in zip(pol, lens, strict=True)])
        odds = (ac - ar) - (np.log1p(-np.exp(ac)) - np.log1p(-np.exp(ar)))
        for k, v in (
            ("nll_loss", -ac if nll is None else np.full(len(ac), nll)),
            ("log_odds_chosen", odds),
            ("log_odds_ratio", logsig(odds)),
            ("rewards/chosen", o.beta * ac),
            ("rewards/margins", o.beta * (ac - ar)),
        ):
            assert metrics[k].item() == pytest.approx(v.sum(), rel=1e-4, abs=1e-5), k

    # gradients: the formula written in MLX over full logits, the reference as constants
    def naive(model):
        total = 0.0
        for p, (rc, rr), (nc, nr) in zip(pairs, ref, lens, strict=True):
            pc, pr = mx_logp(model, p.ids, p.mask), mx_logp(model, p.rejected_ids, p.rejected_mask)
            if o.type == "orpo":
                ac, ar = pc / nc, pr / nr
                odds = (ac - ar) - (mx.log(-mx.expm1(ac)) - mx.log(-mx.expm1(ar)))
                nll = whole_nll(model, pairs, mx_logp) if o.nll_over == "sequence" else -ac
                total = total + nll + o.beta * mx.logaddexp(0.0, -odds)
                continue
            if o.loss == "ipo":
                pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
            h = (pc - rc) - (pr - rr)
            loss = mx_pair_loss(o.loss, h, o.beta, o.label_smoothing)
            total = total + loss + o.rpo_alpha * (-pc / nc)
        return total

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])


def test_padding_prompt_positions_and_packing_change_nothing(tmp_path, llama_dir, prefs):
    """A pair's log-probs are the same whatever it is batched with, however wide the padding
    and with whatever token it pads, padded or packed in rows with other pairs."""
    t = build(recipe(prefs, llama_dir), tmp_path)
    shake_adapters(t.model)
    obj, examples = t.objective, t.train_set.examples[:5]

    def logps(batch):  # attention as a run routes it (packed rows keep their segments apart)
        with kernel_attention(t.model, t.tiers["attention"]):
            return np.array(obj.sequence_logps(t.engine.arrays(batch)))[: len(batch.pairs)]

    alone = np.concatenate([logps(make_pair_batch([p], 0, 8)) for p in examples])
    together = logps(make_pair_batch(examples, 0, 8))
    wide = logps(make_pair_batch(examples, 7, 64))  # another pad token, much more padding
    packed = make_packed_pair_batch([examples[:2], examples[2:]], 3, 200)
    got = logps(packed)[: len(examples)]
    for other in (together, wide, got):
        np.testing.assert_allclose(other, alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(alone, pair_logps(t.model, examples), rtol=1e-5, atol=1e-4)


def test_orpo_whole_sequence_nll_is_the_same_padded_or_packed(tmp_path, llama_dir, prefs):
    """nll_over: sequence scores the chosen sequences' prompts too, never a token across a
    packed row's segments or the padding: padded, packed and the formula agree."""
    r = recipe(prefs, llama_dir, {"type": "orpo", "beta": 0.4, "nll_over": "sequence"})
    t = build(r, tmp_path)
    shake_adapters(t.model)
    obj, ex = t.objective, t.train_set.examples[:5]
    with kernel_attention(t.model, t.tiers["attention"]):
        got = []
        for batch in (
            make_pair_batch(ex, 0, 8),
            make_pair_batch(ex, 7, 64),
            make_packed_pair_batch([ex[:2], ex[2:]], 3, 200),
        ):
            metrics = obj.loss(t.model, t.engine.arrays(batch))[2]
            got.append(metrics["nll_loss"].item() / len(ex))
    assert got == pytest.approx([whole_nll(t.model, ex, naive_logp)] * 3, rel=1e-5)


def test_orpo_sequence_nll_is_trls_per_batch_token_mean_over_length_sorted_batches(
    tmp_path, llama_dir, prefs
):
    """eval_nll_loss with nll_over: sequence is TRL's ORPO nll_loss per batch (the chosen
    sequences' NLL over every token after their first, divided by the batch's such tokens)
    averaged over the eval batches by their pairs (TRL's log: each batch alike). The batches
    are length-sorted, not in file order as TRL's: the value depends on which pairs share a
    batch, the per-pair metrics not."""
    r = recipe(prefs, llama_dir, {"type": "orpo", "beta": 0.4, "nll_over": "sequence"})
    r["eval"]["batch_size"] = 4  # 10 validation pairs: batches of 4, 4 and 2
    t = build(r, tmp_path)
    shake_adapters(t.model)
    ex = t.valid_set.examples
    nll = np.array([-naive_logp(t.model, p.ids, [1] * len(p.ids)) for p in ex])  # float64
    tokens = np.array([len(p.ids) - 1 for p in ex])

    def trl_nll(groups):  # each batch's CrossEntropyLoss over its chosen rows, shifted
        means = [nll[g].sum() / tokens[g].sum() for g in groups]
        return np.average(means, weights=[len(g) for g in groups])

    got = t.evaluate()
    by_length = sorted(range(len(ex)), key=lambda i: ex[i].longest)
    sorted_batches = [by_length[s : s + 4] for s in range(0, len(ex), 4)]
    assert got["eval_nll_loss"] == pytest.approx(trl_nll(sorted_batches), rel=1e-5)
    # (here 4.10161 against 4.10046 in file order and 4.09995 over the whole split at once)
    file_order = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert got["eval_nll_loss"] != pytest.approx(trl_nll(file_order), rel=1e-4)
    assert got["eval_nll_loss"] != pytest.approx(nll.sum() / tokens.sum(), rel=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_splits_keep_pairs_whole_and_sum_to_the_batch(tmp_path, llama_dir, prefs, packed):
    t = build(recipe(prefs, llama_dir), tmp_path)
    shake_adapters(t.model)
    obj, ex = t.objective, t.train_set.examples[:6]
    batch = (
        make_packed_pair_batch([ex[:2], ex[2:3], ex[3:]], 0, 200)
        if packed
        else make_pair_batch(ex, 0, 8)
    )
    routed = kernel_attention(t.model, t.tiers["attention"])
    routed.__enter__()
    whole = obj.loss(t.model, t.engine.arrays(batch))
    for parts in (2, 3, 6):
        micro = obj.split(batch, parts)
        assert sum(obj.count(m) for m in micro) == obj.count(batch) == 6
        for m in micro:  # each slot's two sequences sit in the micro-batch's rows
            seq = m.seq[m.seq >= 0]
            assert set(np.unique(seq // 2)) == set(range(int((m.pairs >= 0).sum())))
            assert len(np.unique(seq)) == 2 * m.n_pairs
        got = [obj.loss(t.model, t.engine.arrays(m)) for m in micro]
        assert sum(g[0].item() for g in got) == pytest.approx(whole[0].item(), rel=1e-5)
        for k in whole[2]:
            assert sum(g[2][k].item() for g in got) == pytest.approx(
                whole[2][k].item(), rel=1e-4, abs=1e-5
            )
    empty = obj.nothing(batch)
    loss, count, _ = obj.loss(t.model, t.engine.arrays(empty))
    routed.__exit__(None, None, None)
    assert loss.item() == 0 and count.item() == 0 == obj.count(empty)


# ------------------------------------------------------------------------ reference policies
def test_the_references_agree_with_a_separately_loaded_base(tmp_path, llama_dir, prefs):
    """Adapters off, a copy of the starting weights and precomputed log-probs are all the base
    (the adapters start at zero); once the adapters move, the reference does not."""
    from mlx_lm import load

    base, _ = load(str(llama_dir))
    for ref in ("auto", "copy", "precomputed"):
        t = build(recipe(prefs, llama_dir, {"type": "dpo", "reference": ref}), tmp_path, ref)
        shake_adapters(t.model, seed=1)  # after prepare(): the reference was kept before
        batch = next(t.objective.batches())[1]
        got = np.array(t.objective.reference_logps(t.model, t.engine.arrays(batch)))
        want = pair_logps(base, batch_pairs(t, batch))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=ref)
    assert (tmp_path / "precomputed" / "reference_logps.safetensors").exists()


def test_precomputed_trains_as_auto_and_both_resume_exactly(tmp_path, llama_dir, prefs):
    auto = recipe(prefs, llama_dir, {"type": "dpo", "reference": "auto"}, checkpoints={"every": 2})
    pre = recipe(
        prefs, llama_dir, {"type": "dpo", "reference": "precomputed"}, checkpoints={"every": 2}
    )
    build(auto, tmp_path, "auto").run()
    build(pre, tmp_path, "pre").run()
    a, p = rows(tmp_path / "auto"), rows(tmp_path / "pre")
    same(a, p, rel=1e-4, abs=1e-5)
    assert {"rewards/margins", "rewards/accuracies", "logps/chosen"} <= a[0].keys()
    evals = [x for x in a if "eval_loss" in x]
    assert evals and all({"eval_rewards/margins", "eval_pairs"} <= x.keys() for x in evals)
    for r, whole in ((auto, a), (pre, p)):
        name = f"crash-{r['objective']['reference']}"
        with pytest.raises(RuntimeError, match="simulated crash"):
            Trainer(
                recipe_from_dict(r),
                run_dir=tmp_path / name,
                console=Console(quiet=True),
                callbacks=[make_crash(4)],
            ).run()
        Trainer(
            recipe_from_dict(r),
            run_dir=tmp_path / name,
            console=Console(quiet=True),
            resume="latest",
        ).run()
        same(rows(tmp_path / name), whole, rel=0, abs=0)


# ------------------------------------------------------------------------ learning
def quickstart(objective: dict):
    """recipes/quickstart-dpo.yaml, its paths made absolute, its objective section updated."""
    r = shipped_recipe("quickstart-dpo.yaml")
    if objective.get("type", "dpo") != "dpo":
        r["objective"] = {}
    r["objective"].update(objective)
    r["samples"] = {"every": None}
    return recipe_from_dict(r)


def preference_accuracy(adapter_dir, rows_) -> float:
    """How often the model prefers the chosen completion (higher log-prob), in float64 from
    mlx-lm's own load of the base and adapter."""
    from mlx_lm import load

    model, tok = load(
        str(REPO / "recipes" / "models" / "reverse-tiny"), adapter_path=str(adapter_dir)
    )
    wins = 0
    for r in rows_:
        p = tok.encode(r["prompt"])
        c, j = (
            tok.encode(r["prompt"] + r["chosen"]) + [tok.eos_token_id],
            tok.encode(r["prompt"] + r["rejected"]) + [tok.eos_token_id],
        )
        mc = [0] * len(p) + [1] * (len(c) - len(p))
        mj = [0] * len(p) + [1] * (len(j) - len(p))
        wins += naive_logp(model, c, mc) > naive_logp(model, j, mj)
    return wins / len(rows_)


@pytest.mark.parametrize(
    "objective, lr, exact",
    [
        # the recipe: DPO with RPO's NLL term (slow for suite time, as the others)
        pytest.param({}, None, 0.8, marks=pytest.mark.slow),
        pytest.param({"type": "orpo", "beta": 0.1}, None, 0.8, marks=pytest.mark.slow),
        # plain DPO learns the preference too, but its greedy answers drift (74-77% measured)
        pytest.param({"rpo_alpha": 0.0, "beta": 1.0}, 5e-4, 0.6, marks=pytest.mark.slow),
    ],
    ids=["dpo-rpo", "orpo", "dpo-plain"],
)
def test_the_quickstart_learns_the_preferred_answer(tmp_path, objective, lr, exact):
    r = quickstart(objective)
    if lr is not None:
        r.optimizer.lr = lr
    held = [
        json.loads(x) for x in (REPO / "recipes/data/prefs/valid.jsonl").read_text().splitlines()
    ]
    before = preference_accuracy(REPO / "recipes" / "models" / "reverse-tiny-mixed", held)
    assert 0.2 <= before <= 0.8  # about chance: the SFT model does both
    s = Trainer(r, run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    after = preference_accuracy(tmp_path / "run" / "export" / "mlx-lm", held)
    assert after >= 0.9
    evals = [x for x in rows(tmp_path / "run") if "eval_rewards/accuracies" in x]
    assert evals[-1]["eval_rewards/accuracies"] >= 0.9
    # greedy answers copy held-out words
    assert s["exact_match_before"] <= 0.4 and s["exact_match_after"] >= exact


# ------------------------------------------------------------------------ reward models
def naive_reward(model, ids) -> mx.array:
    """The score head on the model's own final hidden state of the sequence's last token."""
    return model.score(model.model(mx.array([ids]))[0, -1].astype(mx.float32))[0]


def test_the_reward_loss_is_bradley_terry_in_values_and_gradients(tmp_path, llama_dir, prefs):
    r = recipe(prefs, llama_dir, {"type": "reward", "center_rewards": 0.05})
    t = build(r, tmp_path)
    shake_adapters(t.model)
    obj = t.objective
    batch = next(obj.batches())[1]
    arrays = t.engine.arrays(batch)
    pairs = batch_pairs(t, batch)

    def naive(model):
        total = 0.0
        for p in pairs:
            c, j = naive_reward(model, p.ids), naive_reward(model, p.rejected_ids)
            total = total + mx.logaddexp(0.0, -(c - j)) + 0.05 * mx.square(c + j)
        return total

    scores = np.array(
        [
            [naive_reward(t.model, p.ids).item(), naive_reward(t.model, p.rejected_ids).item()]
            for p in pairs
        ],
        dtype=np.float64,
    )
    want = sum(-logsig(c - j) + 0.05 * (c + j) ** 2 for c, j in scores)
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(pairs)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert metrics["rewards/accuracies"].item() == (scores[:, 0] > scores[:, 1]).sum()
    assert metrics["rewards/margins"].item() == pytest.approx(
        (scores[:, 0] - scores[:, 1]).sum(), rel=1e-5, abs=1e-5
    )
    _, want_g = nn.value_and_grad(t.model, naive)(t.model)
    _, got_g = nn.value_and_grad(t.model, lambda m: obj.loss(m, arrays)[0])(t.model)
    want_g, got_g = dict(tree_flatten(want_g)), dict(tree_flatten(got_g))
    assert "score.weight" in got_g and want_g.keys() == got_g.keys()
    for k in want_g:
        np.testing.assert_allclose(
            np.array(got_g[k]), np.array(want_g[k]), rtol=2e-4, atol=2e-6, err_msg=k
        )
    # packed rows score each sequence at its own last token
    ex = t.train_set.examples[:3]
    with kernel_attention(t.model, t.tiers["attention"]):
        got = obj.rewards(t.model, t.engine.arrays(make_packed_pair_batch([ex], 0, 200)))
    want = [
        [naive_reward(t.model, p.ids).item(), naive_reward(t.model, p.rejected_ids).item()]
        for p in ex
    ]
    np.testing.assert_allclose(np.array(got)[:3], want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_reward_model_learns_resumes_and_exports_with_its_head(tmp_path):
    """From the reverse model, a reward model that scores copying above reversing; held-out
    accuracy read from transformers' own load of the fused export."""
    from mlxtune.export import REWARD_HEAD_FILE

    r = quickstart({"type": "reward"}).to_dict()
    r["adapter"].pop("init_from")
    r["eval"] = {"every": 50, "exact_match": 0}
    r["train"]["max_steps"] = 100
    r["checkpoints"] = {"every": 50}
    r["export"] = {"formats": ["mlx-lm", "peft", "fused", "gguf"]}
    whole = tmp_path / "run"
    s = Trainer(recipe_from_dict(r), run_dir=whole, console=Console(quiet=True)).run()
    assert s["final_eval_loss"] < 0.3
    # exact resume: the head is part of the checkpoint
    part = tmp_path / "part"
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(
            recipe_from_dict(r),
            run_dir=part,
            console=Console(quiet=True),
            callbacks=[make_crash(50)],
        ).run()
    Trainer(recipe_from_dict(r), run_dir=part, console=Console(quiet=True), resume="latest").run()
    same(rows(part), rows(whole), rel=0, abs=0)
    for fmt in ("mlx-lm", "gguf"):  # the head beside the language model's files
        assert (whole / "export" / fmt / REWARD_HEAD_FILE).exists()
    assert list((whole / "export" / "gguf").glob("*.gguf"))
    # a quantized fused export keeps the head dense, where transformers reads it
    from mlxtune.export import export
    from mlxtune.runs.checkpoint import load_trained

    (tmp_path / "q4").mkdir()
    export(load_trained(whole), "fused", tmp_path / "q4", quantize=4, group_size=32)
    import safetensors.numpy

    saved = safetensors.numpy.load_file(str(tmp_path / "q4" / "model.safetensors"))
    assert saved["score.weight"].shape == (1, 128) and "score.scales" not in saved

    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    hf, info = AutoModelForSequenceClassification.from_pretrained(
        str(whole / "export" / "fused"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info
    hf.eval()
    held = [
        json.loads(x) for x in (REPO / "recipes/data/prefs/valid.jsonl").read_text().splitlines()
    ]
    t = Trainer(
        recipe_from_dict(r), run_dir=tmp_path / "dry", console=Console(quiet=True), dry_run=True
    )
    tok = t.tokenizer

    def score(text):
        ids = tok.encode(text) + [tok.eos_token_id]
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, 0].item()

    wins = sum(score(x["prompt"] + x["chosen"]) > score(x["prompt"] + x["rejected"]) for x in held)
    assert wins / len(held) >= 0.9
    # the PEFT export: a sequence classifier's adapter with its head, over the base
    peft = pytest.importorskip("peft")
    base = AutoModelForSequenceClassification.from_pretrained(
        str(REPO / "recipes/models/reverse-tiny"), num_labels=1, dtype=torch.float32
    )
    pm = peft.PeftModel.from_pretrained(base, str(whole / "export" / "peft")).eval()
    ids = tok.encode(held[0]["prompt"] + held[0]["chosen"]) + [tok.eos_token_id]
    with torch.no_grad():
        got = pm(torch.tensor([ids])).logits[0, 0].item()
    assert got == pytest.approx(score(held[0]["prompt"] + held[0]["chosen"]), abs=1e-4)


def test_a_reward_model_refuses_generation_settings(tmp_path, llama_dir, prefs, capsys):
    import yaml

    r = recipe(prefs, llama_dir, {"type": "reward"}, eval={"every": 3, "exact_match": 4})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(r))
    assert main(["run", str(tmp_path / "r.yaml"), "--run-dir", str(tmp_path / "o")]) == 2
    assert "eval.exact_match" in capsys.readouterr().err


def test_checkpointing_packing_and_qlora_train_pairs(tmp_path, llama_dir, prefs):
    """Gradient checkpointing changes no number; packed pairs train as padded ones do (the
    same pairs, other batches: the first step's loss matches a padded step on its pairs); a
    4-bit base trains its adapters."""
    plain = recipe(prefs, llama_dir)
    build(plain, tmp_path, "plain").run()
    ckpt = recipe(prefs, llama_dir, train={**plain["train"], "grad_checkpointing": True})
    build(ckpt, tmp_path, "ckpt").run()
    same(rows(tmp_path / "plain"), rows(tmp_path / "ckpt"), rel=1e-5, abs=1e-6)

    packed = recipe(prefs, llama_dir)
    packed["data"] = {**packed["data"], "packing": "pack", "pack_length": 96}
    packed["train"] = {**packed["train"], "batch_size": 2}
    t = build(packed, tmp_path, "packed")
    batch = next(t.objective.batches())[1]
    assert batch.segments is not None and batch.n_pairs > 2  # several pairs to a row
    from mlxtune.data.preference import make_pair_batch

    pairs = batch_pairs(t, batch)
    with kernel_attention(t.model, t.tiers["attention"]):
        got = t.objective.loss(t.model, t.engine.arrays(batch))[0].item()
        want = t.objective.loss(t.model, t.engine.arrays(make_pair_batch(pairs, 0, 8)))[0].item()
    assert got == pytest.approx(want, rel=1e-5)
    t.run()
    assert all("packing_utilization" in x for x in rows(tmp_path / "packed") if "loss" in x)

    q = recipe(
        prefs, llama_dir, model={"path": str(llama_dir), "quantize": {"bits": 4, "group_size": 32}}
    )
    s = build(q, tmp_path, "qlora").run()
    got = [x for x in rows(tmp_path / "qlora") if "loss" in x]
    assert math.isfinite(s["final_loss"]) and got[-1]["rewards/margins"] > got[0]["rewards/margins"]


def test_out_of_memory_splits_keep_pairs_whole_and_train_the_same(tmp_path, llama_dir, prefs):
    """A step that runs out of memory is split down to one pair a micro-batch (its two rows),
    never further, and trains as the whole batch did."""
    from test_memory import FailBig

    r = recipe(prefs, llama_dir, {"type": "dpo", "beta": 0.5})
    build(r, tmp_path, "plain").run()
    t = build(r, tmp_path, "oom")
    t.engine._train_step = FailBig(t.engine._train_step, rows=2)
    t.engine._grad_step = FailBig(t.engine._grad_step, rows=2)
    t.run()
    same(rows(tmp_path / "oom"), rows(tmp_path / "plain"), rel=1e-4, abs=1e-5)
    assert set(t.engine._grad_step.seen[-6:]) == {2}  # both sequences of one pair
    assert (
        "micro-batches of 1 and grad_accumulation 8" in (tmp_path / "oom" / "log.txt").read_text()
    )


def test_copy_keeps_an_init_from_adapter_and_auto_drops_it(tmp_path):
    """With an SFT adapter to start from, ``copy`` is the SFT model (base + adapter, as mlx-lm
    loads them) and ``auto`` the base alone, after the policy has moved."""
    from mlx_lm import load

    here = REPO / "recipes" / "models"
    with_sft, tok = load(str(here / "reverse-tiny"), adapter_path=str(here / "reverse-tiny-mixed"))
    base, _ = load(str(here / "reverse-tiny"))
    for ref, want_model in (("copy", with_sft), ("auto", base)):
        r = quickstart({"reference": ref})
        t = Trainer(r, run_dir=tmp_path / ref, console=Console(quiet=True))
        shake_adapters(t.model, seed=2)
        batch = next(t.objective.batches())[1]
        got = np.array(t.objective.reference_logps(t.model, t.engine.arrays(batch)))
        want = [
            [
                naive_logp(want_model, p.ids, p.mask),
                naive_logp(want_model, p.rejected_ids, p.rejected_mask),
            ]
            for p in batch_pairs(t, batch)
        ]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=ref)


def test_full_fine_tuning_in_bfloat16_keeps_a_copy_as_its_reference(tmp_path, llama_dir, prefs):
    r = recipe(prefs, llama_dir, {"type": "dpo", "beta": 0.5}, adapter={"type": "full"})
    r["model"] = {"path": str(llama_dir), "dtype": "bfloat16"}
    r["optimizer"] = {"lr": 1e-3}
    t = build(r, tmp_path)
    assert t.objective.reference == "copy"
    s = t.run()
    got = [x for x in rows(tmp_path / "run") if "loss" in x]
    assert math.isfinite(s["final_loss"]) and got[0]["loss"] == pytest.approx(math.log(2), abs=0.01)
    assert got[-1]["rewards/margins"] > 0


def test_the_memory_advice_counts_pairs_not_rows(tmp_path, llama_dir, prefs, capsys):
    """Refused for memory, a DPO run is told a smaller train.batch_size in pairs (two rows
    each), and a packed one a max_length that fits two sequences in a row."""
    from dataclasses import replace

    import yaml

    from mlxtune.memory import estimate, shape_of

    def refused(r, name):
        # a budget that half the batch (or half the row) fits and the whole does not
        probe = dict(r, memory={"check": "off"})
        shape = shape_of(build(probe, tmp_path, f"probe-{name}"))
        half = replace(shape, batch=shape.batch // 2, length=shape.length // 2)
        limit = (estimate(shape)["total"] + estimate(half)["total"]) / 2 / 1e9
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(dict(r, memory={"limit_gb": limit})))
        assert main(["run", str(tmp_path / "r.yaml"), "--run-dir", str(tmp_path / name)]) == 2
        return capsys.readouterr().err

    r = recipe(prefs, llama_dir)  # 6 pairs a batch: 12 rows
    assert "train.batch_size: 3 with train.grad_accumulation: 2 (the same 6 examples" in refused(
        r, "o"
    )
    r["data"] = {**r["data"], "packing": "pack", "pack_length": 97}
    assert "data.pack_length: 49 with data.max_length at most 24" in refused(r, "p")


def test_validate_and_dry_run_describe_a_preference_run(tmp_path, llama_dir, prefs, capsys):
    import yaml

    r = recipe(prefs, llama_dir, {"type": "dpo", "reference": "precomputed"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(r))
    assert main(["validate", str(tmp_path / "r.yaml")]) == 0
    assert main(["run", str(tmp_path / "r.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "6 pairs/step" in text and "objective dpo" in text and "48 pairs" in text
    assert "dry run: one step compiled and ran" in text
    assert "reference: log-probs of 58 pairs computed once" in text
