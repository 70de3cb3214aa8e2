"""Sophia's curvature estimate in a run: its expectation is the Gauss-Newton diagonal (computed
here in NumPy float64 for the LM head), it is taken every k steps, and objectives that draw no
labels refuse it."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_recipe, write_jsonl
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.errors import UserInputError
from mlxtune.loop.callbacks import FunctionCallback


def trainer(tmp_path, data_dir, model_dir, **over):
    r = tiny_recipe(
        data_dir,
        model_dir,
        adapter={"type": "full"},
        optimizer={"name": "sophia", "lr": 1e-3, "sophia": {"k": 3}},
        train={"batch_size": 4, "max_steps": 5, "log_every": 1, "progress": False},
        eval={"every": None, "max_batches": 1},
        **over,
    )
    return Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True))


def softmax64(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def test_the_drawn_label_estimate_averages_to_the_gauss_newton_diagonal(
    tmp_path, data_dir, model_dir_factory
):
    """For the LM head W [V, D] over hidden states x_i at n target positions with predictions
    p_i, the Gauss-Newton diagonal of the mean loss, times n, is (1/n) sum_i p_iv (1 - p_iv)
    x_id^2: what n g^2 of the drawn-label gradient g averages to."""
    tr = trainer(tmp_path, data_dir, model_dir_factory("mistral"))  # an untied head
    obj, model = tr.objective, tr.model
    batch = tr.engine.arrays(next(tr.batches())[1])
    mask = np.array(batch["mask"][:, 1:]) > 0
    x = np.array(obj.hidden(batch), np.float64)[mask]  # [n, D]
    w = np.array(model.lm_head.weight, np.float64)
    p = softmax64(x @ w.T)
    n = x.shape[0]
    want = (p * (1 - p)).T @ (x**2) / n  # [V, D]

    def drawn(model, batch):
        loss, count = obj.sampled_loss(model, batch)
        return loss / count

    grad_fn = nn.value_and_grad(model, drawn)
    state = [model.state, mx.random.state]
    grad = mx.compile(lambda b: grad_fn(model, b), inputs=state, outputs=state)
    mx.random.seed(7)
    draws = 256
    total = np.zeros_like(want)
    for _ in range(draws):
        _, g = grad(batch)
        total += n * np.array(g["lm_head"]["weight"], np.float64) ** 2
    got = total / draws
    # Monte Carlo over 256 draws: the entries within 0.3 (measured 0.17, falling as
    # 1/sqrt(draws): 0.33 at 64, 0.08 at 1024), their sum within 3% (measured 0.7%)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.3, rel
    assert abs(got.sum() / want.sum() - 1) < 0.03
    # the true labels' gradient squared is another matrix altogether (the draw matters)
    _, g_true = nn.value_and_grad(model, lambda m, b: obj.loss(m, b)[0] / obj.loss(m, b)[1])(
        model, batch
    )
    true = n * np.array(g_true["lm_head"]["weight"], np.float64) ** 2
    assert np.linalg.norm(true - want) / np.linalg.norm(want) > 3 * rel
    assert abs(true.sum() / want.sum() - 1) > 0.1


def test_the_curvature_is_estimated_every_k_steps(tmp_path, data_dir, llama_dir):
    """k = 3: before steps 1 and 4 the estimate moves h; steps 2, 3 and 5 leave it."""
    tr = trainer(tmp_path, data_dir, llama_dir)
    seen = []

    def record(trainer, event):
        opt = trainer.optimizer
        mx.eval(opt.state)
        seen.append({k: np.array(v) for k, v in tree_flatten(opt.state) if k.endswith(".h")})

    tr.callbacks.append(FunctionCallback(record))
    tr.run()
    assert len(seen) == 5 and all(np.abs(h).max() > 0 for h in seen[0].values())
    moved = [
        any(not np.array_equal(a[k], b[k]) for k in a) for a, b in zip(seen, seen[1:], strict=False)
    ]
    assert moved == [False, False, True, False]  # between 1-2, 2-3, 3-4, 4-5


def test_sophia_needs_an_objective_that_draws_labels(tmp_path, data_dir, llama_dir):
    rows = [{"prompt": f"p{i} =", "chosen": " yes", "rejected": " no"} for i in range(12)]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(UserInputError) as e:
        trainer(
            tmp_path,
            data_dir,
            llama_dir,
            objective={"type": "dpo"},
            data={"train": str(tmp_path / "pairs.jsonl"), "max_length": 48},
        )
    assert e.value.where == "optimizer.name" and "sophia" in str(e.value)
