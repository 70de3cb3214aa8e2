"""A new objective is one class plus its recipe section: defined here, in the test, it trains a
tiny model through ``mlxtune.Trainer`` and the CLI, logs its own metric, evaluates, checkpoints
and resumes exactly, without any change to the loop or the engine."""

import importlib.util
import json
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
import yaml

from conftest import REPO, crash_and_resume, tiny_recipe
from conftest import run_rows as rows
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.config import ObjectiveConfig
from mlxtune.console import Console
from mlxtune.data import make_batch
from mlxtune.objectives import SFT, register, unregister


# ------------------------------------------------------------------ the objective (~35 lines)
@dataclass
class SequenceMeanConfig(ObjectiveConfig):
    """Each sequence's mean token loss, averaged over sequences, its tokens weighted by a ramp."""

    type: str = "sequence_mean_test"
    """This objective."""
    ramp: float = 0.5
    """Target j of a sequence with n targets weighs 1 + ramp * j / n."""


class SequenceMean(SFT):
    """Counts sequences, not tokens: short answers weigh as much as long ones."""

    name = "sequence_mean_test"
    Config = SequenceMeanConfig

    def loss(self, model, batch):
        per_token, _ = self.token_losses(batch, reduction="none")  # [B, T-1]
        on = (batch["mask"][:, 1:] > 0).astype(mx.float32)
        n = on.sum(axis=1)
        j = mx.cumsum(on, axis=1) - 1  # each target's index within its sequence
        w = (1 + self.config.ramp * j / mx.maximum(n, 1)[:, None]) * on
        per_seq = (per_token * w).sum(axis=1) / mx.maximum(w.sum(axis=1), 1e-9)
        has = (n > 0).astype(mx.float32)
        return (per_seq * has).sum(), has.sum(), {"targets_per_sequence": n.sum()}

    def count(self, batch):
        return int((batch.mask[:, 1:].sum(axis=1) > 0).sum())


@pytest.fixture
def sequence_mean():
    register(SequenceMean)
    yield SequenceMean
    unregister(SequenceMean.name)


# ------------------------------------------------------------------ the tests
def naive_loss(logits: np.ndarray, tokens: np.ndarray, mask: np.ndarray, ramp: float) -> float:
    """The objective's loss in float64 from full logits, written out loop by loop."""
    logits = logits.astype(np.float64)
    total = 0.0
    for i in range(len(tokens)):
        targets = [j for j in range(1, tokens.shape[1]) if mask[i, j]]
        if not targets:
            continue
        num = den = 0.0
        for k, j in enumerate(targets):
            row = logits[i, j - 1]
            nll = np.log(np.exp(row - row.max()).sum()) + row.max() - row[tokens[i, j]]
            w = 1 + ramp * k / len(targets)
            num, den = num + w * nll, den + w
        total += num / den
    return total


def recipe(data_dir, llama_dir, objective=None):
    return tiny_recipe(
        data_dir,
        llama_dir,
        objective=objective or {"type": "sequence_mean_test", "ramp": 2.0},
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False, "seed": 5},
        eval={"every": 4},
        checkpoints={"every": 4, "keep_last": 3},
    )


def test_the_objective_computes_its_loss_and_count(tmp_path, data_dir, llama_dir, sequence_mean):
    tr = Trainer(
        recipe_from_dict(recipe(data_dir, llama_dir)), tmp_path / "r", console=Console(quiet=True)
    )
    assert isinstance(tr.objective, SequenceMean) and tr.objective.config.ramp == 2.0
    exs = tr.train_set.examples[:5]
    b = make_batch(exs, tr.pad_id, 8)
    loss, count, metrics = tr.objective.loss(tr.model, tr.engine.arrays(b))
    logits = np.array(tr.model(mx.array(b.tokens)))
    want = naive_loss(logits, b.tokens, b.mask, 2.0)
    assert count.item() == tr.objective.count(b) == 5
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert metrics["targets_per_sequence"].item() == sum(e.n_targets for e in exs)


def test_it_trains_logs_its_metric_and_resumes_exactly(
    tmp_path, data_dir, llama_dir, sequence_mean
):
    r = recipe(data_dir, llama_dir)
    summary = Trainer(recipe_from_dict(r), tmp_path / "whole", console=Console(quiet=True)).run()
    want = rows(tmp_path / "whole")
    steps = [x for x in want if "loss" in x]
    assert summary["steps"] == 8 and len(steps) == 8
    assert steps[-1]["loss"] < steps[0]["loss"]
    # the metric is the sum over the window divided by its count: targets per sequence
    assert all(2 <= x["targets_per_sequence"] <= 48 for x in steps)
    evals = [x for x in want if "eval_loss" in x]
    assert [x["step"] for x in evals] == [4, 8]
    state = json.loads((tmp_path / "whole/checkpoints/step-000004/trainer_state.json").read_text())
    assert state["recipe"]["objective"] == {"type": "sequence_mean_test", "ramp": 2.0}

    crash_and_resume(r, tmp_path, 6)
    assert rows(tmp_path / "cut") == want


def test_the_documented_objective_trains(tmp_path, data_dir, llama_dir):
    readme = (REPO / "docs" / "library.md").read_text()
    code = readme.split("<!-- objective-example -->", 1)[1].split("```python\n", 1)[1]
    module = tmp_path / "readme_objective.py"  # a module, as a user writes one
    module.write_text(code.split("```", 1)[0])
    spec = importlib.util.spec_from_file_location("readme_objective", module)
    mod = sys.modules["readme_objective"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        r = recipe(data_dir, llama_dir, objective={"type": "sequence_mean"})
        tr = Trainer(recipe_from_dict(r), tmp_path / "r", console=Console(quiet=True))
        b = make_batch(tr.train_set.examples[:4], tr.pad_id, 8)
        loss, count, _ = tr.objective.loss(tr.model, tr.engine.arrays(b))
        want = naive_loss(np.array(tr.model(mx.array(b.tokens))), b.tokens, b.mask, 0.0)
        assert count.item() == 4 and loss.item() == pytest.approx(want, rel=1e-5)
        assert tr.run()["steps"] == 8
    finally:
        unregister("sequence_mean")
        del sys.modules["readme_objective"]


def test_the_cli_runs_it_and_checks_its_keys(tmp_path, data_dir, llama_dir, sequence_mean, capsys):
    r = recipe(data_dir, llama_dir)
    r["train"]["max_steps"] = 4
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "run")]) == 0
    assert [x["step"] for x in rows(tmp_path / "run") if "targets_per_sequence" in x] == [
        1,
        2,
        3,
        4,
    ]
    capsys.readouterr()
    r["objective"]["ramp"] = "steep"
    p.write_text(yaml.safe_dump(r))
    assert main(["validate", str(p)]) == 2
    assert "objective.ramp" in capsys.readouterr().err
