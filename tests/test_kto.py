"""KTO on unpaired feedback: each example's mismatched sequence; both losses against their
formulas over full logits (float64 values, MLX gradients), the KL reference point by hand;
precomputed references, exact resume; preference data unpaired on request; the class-balance
warning; bad input; and learning on the shipped quickstart-kto task."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import yaml

from conftest import (
    LETTERS,
    crash_and_resume,
    mx_logp,
    naive_logp,
    objective_recipe,
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
from mlxtune.adapters import LoRALinear
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.objectives.base import metric_means
from mlxtune.objectives.kto import class_balance_advice


def feedback_rows(n, seed=0):
    """ "reverse w =" answered with the reversal (desirable) or the word (undesirable)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w = "".join(rng.choice(list(LETTERS), rng.integers(3, 8)))
        good = bool(i % 2 == 0 or rng.random() < 0.3)
        out.append(
            {"prompt": f"reverse {w} =", "completion": f" {w[::-1] if good else w}", "label": good}
        )
    return out


@pytest.fixture
def feedback(tmp_path):
    return write_splits(tmp_path / "feedback", feedback_rows, 48, 10)


def recipe(data, model_dir, objective=None, **over):
    return objective_recipe(
        "kto", model_dir, data, objective or {"type": "kto", "beta": 0.5}, **over
    )


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_each_example_borrows_the_next_other_prompts_completion(tmp_path, llama_dir, tokenizer):
    """The KL sequence is the example's prompt and the completion of the next row (wrapping)
    whose prompt differs; both score only their completion."""
    d = tmp_path / "d"
    data = [
        {"prompt": "reverse ab =", "completion": " ba", "label": True},
        {"prompt": "reverse ab =", "completion": " ab", "label": False},  # same prompt: skipped
        {"prompt": "reverse cde =", "completion": " edc", "label": True},
        {"prompt": "reverse fg =", "completion": " fg", "label": False},
    ]
    write_jsonl(d / "train.jsonl", data)
    write_jsonl(d / "valid.jsonl", data)
    t = build(recipe(d, llama_dir), tmp_path)
    ex = t.train_set.examples
    partners = [2, 2, 3, 0]
    for e, row, j in zip(ex, data, partners, strict=True):
        assert e.label is row["label"]
        want = tokenizer.encode(row["prompt"] + data[j]["completion"])
        assert e.rejected_ids[: len(want)] == want
        prompt = len(tokenizer.encode(row["prompt"]))
        assert e.rejected_mask[:prompt] == [0] * prompt and sum(e.rejected_mask) > 0


@pytest.mark.parametrize(
    "objective",
    [
        {"type": "kto", "beta": 0.5},
        {"type": "kto", "beta": 0.3, "desirable_weight": 1.3, "undesirable_weight": 0.7},
        {"type": "kto", "beta": 0.4, "loss": "apo_zero_unpaired"},
    ],
    ids=["kto", "kto-weights", "apo-zero-unpaired"],
)
def test_each_loss_is_its_formula_in_values_and_gradients(tmp_path, llama_dir, feedback, objective):
    from mlx_lm import load

    t = build(recipe(feedback, llama_dir, objective), tmp_path)
    shake_adapters(t.model)
    base, _ = load(str(llama_dir))  # the reference (auto: adapters off), loaded on its own
    obj, o = t.objective, t.recipe.objective
    batch = next(obj.batches())[1]
    arrays = t.engine.arrays(batch)
    exs = [t.train_set.examples[i] for i in batch.pairs if i >= 0]
    pol = np.array([naive_logp(t.model, e.ids, e.mask) for e in exs])
    ref = np.array([naive_logp(base, e.ids, e.mask) for e in exs])
    pol_kl = np.array([naive_logp(t.model, e.rejected_ids, e.rejected_mask) for e in exs])
    ref_kl = np.array([naive_logp(base, e.rejected_ids, e.rejected_mask) for e in exs])
    label = np.array([e.label for e in exs], dtype=np.float64)
    assert 0 < label.sum() < len(exs)  # both classes in the batch
    z0 = float(max((pol_kl - ref_kl).mean(), 0.0))
    r = pol - ref
    b, dw, uw = o.beta, o.desirable_weight, o.undesirable_weight
    if o.loss == "kto":
        want = label * dw * (1 - sigmoid(b * (r - z0))) + (1 - label) * uw * (
            1 - sigmoid(b * (z0 - r))
        )
    else:
        want = label * dw * (1 - sigmoid(b * r)) + (1 - label) * uw * sigmoid(b * r)
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(exs) == obj.count(batch)
    assert loss.item() == pytest.approx(want.sum(), rel=2e-5, abs=1e-5)
    assert metrics["kl"].item() / len(exs) == pytest.approx(z0, rel=1e-4, abs=1e-5)
    good, bad = label > 0, label == 0
    means = metric_means({k: v.item() for k, v in metrics.items()}, len(exs))
    assert means["rewards/chosen"] == pytest.approx((b * r[good]).mean(), rel=1e-4, abs=1e-5)
    assert means["logps/rejected"] == pytest.approx(pol[bad].mean(), rel=1e-4, abs=1e-5)

    def naive(model):  # the formula in MLX over full logits; the reference and z0 constants
        total = 0.0
        for e, rc, y in zip(exs, ref, label, strict=True):
            ratio = mx_logp(model, e.ids, e.mask) - rc
            if o.loss == "kto":
                term = (
                    dw * (1 - mx.sigmoid(b * (ratio - z0)))
                    if y
                    else uw * (1 - mx.sigmoid(b * (z0 - ratio)))
                )
            else:
                term = dw * (1 - mx.sigmoid(b * ratio)) if y else uw * mx.sigmoid(b * ratio)
            total = total + term
        return total

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])


def test_the_reference_point_is_clamped_at_zero(tmp_path, llama_dir, feedback):
    """With the policy equal to the reference the mismatched log-ratios are 0, and a policy
    that finds the mismatched completions less likely than the reference gives z0 = 0 too."""
    t = build(recipe(feedback, llama_dir), tmp_path)
    arrays = t.engine.arrays(next(t.objective.batches())[1])
    _, _, metrics = t.objective.loss(t.model, arrays)  # adapters at zero: the reference
    assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-4)
    for _, m in t.model.named_modules():  # push every logit scale far: mismatches unlikely
        if isinstance(m, LoRALinear):
            m.lora_b = mx.full(m.lora_b.shape, 0.5)
    assert t.objective.loss(t.model, arrays)[2]["kl"].item() >= 0.0


def test_precomputed_trains_as_auto_and_both_resume_exactly(tmp_path, llama_dir, feedback):
    auto = recipe(feedback, llama_dir, {"type": "kto"}, checkpoints={"every": 2})
    pre = recipe(
        feedback, llama_dir, {"type": "kto", "reference": "precomputed"}, checkpoints={"every": 2}
    )
    build(auto, tmp_path, "auto").run()
    build(pre, tmp_path, "pre").run()
    a, p = rows(tmp_path / "auto"), rows(tmp_path / "pre")
    same_rows(a, p, rel=1e-4, abs=1e-5)
    assert {"kl", "rewards/chosen", "rewards/margins", "logps/rejected"} <= a[1].keys()
    evals = [x for x in a if "eval_loss" in x]
    assert evals and all({"eval_kl", "eval_examples"} <= x.keys() for x in evals)
    for r, whole in ((auto, a), (pre, p)):
        name = f"crash-{r['objective'].get('reference', 'auto')}"
        crash_and_resume(r, tmp_path, 4, name)
        same_rows(rows(tmp_path / name), whole, rel=0, abs=0)


def test_preference_pairs_train_when_unpaired_and_are_refused_otherwise(
    tmp_path, llama_dir, capsys
):
    d = tmp_path / "pairs"
    pairs = [
        {"prompt": f"reverse {w} =", "chosen": f" {w[::-1]}", "rejected": f" {w}"}
        for w in ("abc", "defg", "hij", "klmno", "pqr", "stu")
    ]
    write_jsonl(d / "train.jsonl", pairs)
    write_jsonl(d / "valid.jsonl", pairs[:2])
    t = build(recipe(d, llama_dir, {"type": "kto", "unpair": True}), tmp_path)
    ex = t.train_set.examples
    assert len(ex) == 12 and [e.label for e in ex] == [True, False] * 6
    assert ex[0].answer == pairs[0]["chosen"] and ex[1].answer == pairs[0]["rejected"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(d, llama_dir, {"type": "kto"})))
    assert main(["run", str(path), "--run-dir", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl:1" in err and "objective.unpair: true" in err and "Traceback" not in err


def test_unbalanced_classes_are_warned_of_with_the_weights_that_would_do():
    assert class_balance_advice(50, 50, 1.0, 1.0) is None  # 1 : 1
    assert class_balance_advice(60, 50, 1.0, 1.0) is None  # 1.2 : 1
    advice = class_balance_advice(100, 20, 1.0, 1.0)  # 5 : 1
    assert advice is not None and "5.00 : 1" in advice
    # the desirable weight it names puts the ratio at the range's ends
    assert "desirable_weight in [0.2, 0.267]" in advice
    assert "undesirable_weight in [3.75, 5]" in advice
    assert class_balance_advice(100, 20, 0.25, 1.0) is None  # 1.25 : 1
    assert class_balance_advice(10, 0, 1.0, 1.0) is None  # one class: nothing to weigh


def test_a_run_logs_the_class_balance_warning(tmp_path, llama_dir):
    d = tmp_path / "skewed"
    skewed = [dict(r, label=True) for r in feedback_rows(20, 4)]
    skewed[0]["label"] = False
    write_jsonl(d / "train.jsonl", skewed)
    write_jsonl(d / "valid.jsonl", skewed[:4])
    build(recipe(d, llama_dir, train={"max_steps": 1, "progress": False}), tmp_path).run()
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "WARNING: 19 desirable and 1 undesirable examples" in log


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "a", "completion": " b", "label": "yes"}, "field 'label' must be a bool"),
        ({"prompt": "a", "completion": ["x"], "label": True}, "both be strings"),
        ({"text": "hello"}, "missing field 'label'"),
    ],
    ids=["label", "mixed", "text"],
)
def test_bad_feedback_names_the_line_and_exits_2(
    tmp_path, llama_dir, feedback, capsys, row, message
):
    bad = feedback_rows(4) + [row]
    write_jsonl(tmp_path / "bad.jsonl", bad)
    r = recipe(feedback, llama_dir)
    r["data"]["train"] = str(tmp_path / "bad.jsonl")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    assert main(["run", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:5" in err and message in err and "Traceback" not in err


def test_sft_refuses_feedback(tmp_path, llama_dir, feedback, capsys):
    r = recipe(feedback, llama_dir, {"type": "sft"})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    assert main(["run", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    assert "objective.type kto" in capsys.readouterr().err


@pytest.mark.slow  # about 40 s: the default suite stays under 10 minutes
def test_the_quickstart_learns_to_copy(tmp_path):
    r = shipped_recipe("quickstart-kto.yaml")
    r["samples"] = {"every": None}
    s = Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    assert s["exact_match_before"] <= 0.4 and s["exact_match_after"] >= 0.9
    evals = [x for x in rows(tmp_path / "run") if "eval_rewards/margins" in x]
    assert evals[-1]["eval_rewards/margins"] > 0


def test_class_means_average_the_batches_that_hold_the_class(tmp_path, llama_dir):
    """As TRL's KTOTrainer logs them: a class's mean reward in each batch that holds the class,
    averaged over those batches (a batch without it adds nothing, and counts for nothing); the
    margin over the batches that hold both."""
    from mlx_lm import load

    valid = feedback_rows(6, 4)
    for i, r in enumerate(valid):  # one undesirable row in the validation set
        w = r["prompt"].split()[1]
        r["label"], r["completion"] = i != 0, " " + (w if i == 0 else w[::-1])
    data = write_splits(
        tmp_path / "fb", lambda n, seed: valid if seed == 2 else feedback_rows(n, 5), 24, 6
    )
    t = build(recipe(data, llama_dir, eval={"every": None, "batch_size": 2}), tmp_path)
    shake_adapters(t.model)
    base, _ = load(str(llama_dir))
    b = t.recipe.objective.beta
    per_class: dict = {"chosen": [], "rejected": [], "margins": []}
    for batch in t.objective.eval_batches():
        exs = [t.valid_set.examples[i] for i in batch.pairs if i >= 0]
        r = np.array(
            [naive_logp(t.model, e.ids, e.mask) - naive_logp(base, e.ids, e.mask) for e in exs]
        )
        label = np.array([e.label for e in exs])
        means = {
            c: (b * r[m]).mean() for c, m in (("chosen", label), ("rejected", ~label)) if m.any()
        }
        for c, v in means.items():
            per_class[c].append(v)
        if len(means) == 2:
            per_class["margins"].append(means["chosen"] - means["rejected"])
    assert len(per_class["rejected"]) == 1 < len(per_class["chosen"])  # a batch lacks the class
    got = t.evaluate()
    for c, values in per_class.items():
        assert got[f"eval_rewards/{c}"] == pytest.approx(np.mean(values), rel=1e-4, abs=1e-5)


def test_exact_match_uses_desirable_rows_only_in_training_and_in_eval(
    tmp_path, llama_dir, feedback
):
    """An undesirable completion is no reference answer: neither the run's exact match nor
    ``mlxtune eval``'s scores it."""
    from mlxtune.evaluate import evaluate_run

    test = feedback_rows(10, 7)
    write_jsonl(feedback / "test.jsonl", test)
    r = recipe(feedback, llama_dir, max_steps=1)
    r["data"]["test"] = str(feedback / "test.jsonl")
    r["eval"] = {"every": None, "exact_match": 100, "max_new_tokens": 4}
    build(r, tmp_path).run()
    desirable = sum(row["label"] for row in test)
    assert 0 < desirable < len(test)
    trained = [x for x in rows(tmp_path / "run") if "exact_match_after" in x]
    assert trained[-1]["exact_match_examples"] == desirable
    out = evaluate_run(tmp_path / "run")
    assert all(m["exact_match_examples"] == desirable for m in out["models"].values())
