"""Dynamic fine-tuning (objective.loss: dft): each target token's cross-entropy scaled by its
detached probability, against the formula over full logits in float64 values and MLX gradients;
evaluation keeps the plain cross-entropy; a run trains with it; a smoothed loss is refused."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import (
    build_run,
    crash_and_resume,
    run_rows,
    same_gradients,
    same_rows,
    shake_adapters,
    tiny_recipe,
)
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console


def rows_of(batch):
    """Each row's tokens and target mask, trimmed to its length."""
    return [
        (batch.tokens[i, :n].tolist(), batch.mask[i, :n].tolist())
        for i, n in enumerate(batch.lengths)
    ]


def token_ce64(model, ids, mask):
    """Each target token's cross-entropy, from the model's full logits in float64."""
    logits = np.array(model(mx.array([ids[:-1]]))[0], dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.array([-logp[j, ids[j + 1]] for j in range(len(ids) - 1) if mask[j + 1]])


def test_dft_is_its_formula_in_values_and_gradients(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(data_dir, llama_dir, objective={"type": "sft", "loss": "dft"})
    t = Trainer(recipe_from_dict(r), tmp_path / "r", console=Console(quiet=True))
    shake_adapters(t.model)  # so that the adapters take part in the gradients' values
    obj = t.objective
    batch = next(iter(obj.batches()))[1]
    arrays = t.engine.arrays(batch)
    rows = rows_of(batch)
    ce = np.concatenate([token_ce64(t.model, ids, mask) for ids, mask in rows])

    t.model.train()
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == ce.size
    assert loss.item() == pytest.approx(float((np.exp(-ce) * ce).sum()), rel=2e-5)
    assert metrics["nll"].item() == pytest.approx(float(ce.sum()), rel=2e-5)
    t.model.eval()  # evaluation: the plain cross-entropy
    loss, count, metrics = obj.loss(t.model, arrays)
    assert loss.item() == pytest.approx(float(ce.sum()), rel=2e-5) and "nll" not in metrics
    t.model.train()

    def naive(model):  # the formula in MLX over full logits, the scale held constant
        total = 0.0
        for ids, mask in rows:
            logits = model(mx.array([ids[:-1]]))[0].astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1)[:, 0]
            tok = -picked * mx.array(mask[1:], dtype=mx.float32)
            total = total + mx.sum(mx.stop_gradient(mx.exp(-tok)) * tok)
        return total

    want = same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])
    # and it is not the plain cross-entropy's gradient
    _, plain = nn.value_and_grad(t.model, lambda m: obj.token_losses(arrays)[0])(t.model)
    plain = dict(tree_flatten(plain))
    assert any(not np.allclose(np.array(plain[k]), np.array(want[k]), rtol=1e-2) for k in want)


def test_a_dft_run_trains_and_logs_the_plain_cross_entropy(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(data_dir, llama_dir, objective={"type": "sft", "loss": "dft"})
    r["train"].update(max_steps=12, log_every=3)
    r["eval"] = {"every": 12}
    summary = Trainer(recipe_from_dict(r), tmp_path / "r", console=Console(quiet=True)).run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if "loss" in x]
    assert all(0 < x["loss"] < x["nll"] for x in train)  # p < 1: each term below its CE
    assert train[-1]["nll"] < train[0]["nll"]
    assert summary["final_eval_loss"] == pytest.approx(
        next(x["eval_loss"] for x in rows if "eval_loss" in x and x["step"] == 12)
    )


def test_a_dft_run_resumes_exactly(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(data_dir, llama_dir, objective={"type": "sft", "loss": "dft"})
    r["train"].update(max_steps=6, log_every=1)
    r["checkpoints"] = {"every": 2}
    build_run(r, tmp_path, "whole").run()
    crash_and_resume(r, tmp_path, 3, "crash")
    whole = run_rows(tmp_path / "whole")
    assert any("nll" in x for x in whole)
    same_rows(run_rows(tmp_path / "crash"), whole, rel=0, abs=0)


def test_dft_with_label_smoothing_exits_2(tmp_path, data_dir, llama_dir, capsys):
    import yaml

    r = tiny_recipe(data_dir, llama_dir, objective={"type": "sft", "loss": "dft"})
    r["train"]["label_smoothing"] = 0.1
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    assert main(["run", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train.label_smoothing" in err and "dft" in err and "Traceback" not in err
