"""Early stopping on an evaluation metric, the best checkpoint by it, and the best weights put
back at the end (checkpoints.load_best_at_end). Where a run should stop and which evaluation is
best are replayed here from the evaluation rows the run wrote, by the rule written out below."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import make_crash, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.errors import UserInputError


def run(tmp_path, data_dir, llama_dir, name, stopping, crash=None, resume=None, **over):
    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={
            "batch_size": 8,
            "max_steps": 24,
            "log_every": 1,
            "progress": False,
            "early_stopping": stopping,
        },
        **{
            "eval": {"every": 2, "max_batches": 1},
            "checkpoints": {"every": 2, "keep_last": 20},
            **over,
        },
    )
    tr = Trainer(
        recipe_from_dict(r),
        run_dir=tmp_path / name,
        console=Console(quiet=True),
        callbacks=[make_crash(crash)] if crash else [],
        resume=resume,
    )
    return tr.run()


def eval_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def replay(rows, metric, higher, patience, min_delta):
    """(the step the run should stop after, the best evaluation's step): patience counts the
    evaluations in a row that beat the best so far by no more than min_delta."""
    best, best_step, stalled = None, None, 0
    for row in rows:
        v = row[metric] if higher else -row[metric]
        if best is None or v - best > min_delta:
            stalled = 0
        else:
            stalled += 1
        if best is None or v > best:
            best, best_step = v, row["step"]
        if stalled >= patience:
            return row["step"], best_step
    return None, best_step


def test_a_metric_that_stops_improving_stops_the_run_and_resume_keeps_the_count(
    tmp_path, data_dir, llama_dir
):
    """eval_ppl watched as if higher were better: the loss falls, so no evaluation after the
    first counts, and the run ends `patience` evaluations later; a run cut between them and
    resumed stops at the same step (the count is in the checkpoint)."""
    stopping = {"patience": 3, "metric": "eval_ppl", "mode": "max"}
    summary = run(tmp_path, data_dir, llama_dir, "whole", stopping)
    rows = eval_rows(tmp_path / "whole")
    stop, best_step = replay(rows, "eval_ppl", True, 3, 0.0)
    assert stop is not None and stop < 24 and rows[-1]["step"] == stop
    assert summary["steps"] == stop and summary["stopped_early"] is True
    # no second evaluation of the step it stopped at
    assert [r["step"] for r in rows].count(stop) == 1
    best = json.loads((tmp_path / "whole/checkpoints/best/trainer_state.json").read_text())
    assert best["step"] == best_step and best["eval_ppl"] == pytest.approx(
        max(r["eval_ppl"] for r in rows)
    )
    # cut after step 5 (its checkpoint at step 4, two evaluations counted), then resumed
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path, data_dir, llama_dir, "cut", stopping, crash=5)
    again = run(tmp_path, data_dir, llama_dir, "cut", stopping, resume="latest")
    assert again["steps"] == stop
    assert [r["step"] for r in eval_rows(tmp_path / "cut")] == [r["step"] for r in rows]


def test_min_delta_decides_what_counts_and_the_best_weights_come_back(
    tmp_path, data_dir, llama_dir
):
    """With a min_delta larger than any change, the run stops `patience` evaluations after the
    first; load_best_at_end puts back the weights of the best evaluation (eval_loss watched as
    if higher were better: the first, as the loss falls) and reports its evaluation."""
    stopping = {"patience": 2, "min_delta": 100.0, "metric": "eval_loss", "mode": "max"}
    summary = run(
        tmp_path,
        data_dir,
        llama_dir,
        "delta",
        stopping,
        checkpoints={"every": 2, "keep_last": 20, "load_best_at_end": True},
    )
    rows = eval_rows(tmp_path / "delta")
    stop, best_step = replay(rows, "eval_loss", True, 2, 100.0)
    assert summary["steps"] == stop == rows[2]["step"]
    best_row = max(rows, key=lambda r: r["eval_loss"])
    assert best_step == best_row["step"]
    assert summary["final_eval_loss"] == pytest.approx(best_row["eval_loss"])
    ckpt = tmp_path / "delta" / "checkpoints"
    final = mx.load(str(ckpt / "final" / "adapters.safetensors"))
    at_best = mx.load(str(ckpt / f"step-{best_step:06d}" / "adapters.safetensors"))
    last = mx.load(str(ckpt / f"step-{stop:06d}" / "adapters.safetensors"))
    for k in final:
        np.testing.assert_array_equal(np.array(final[k]), np.array(at_best[k]))
    assert best_step < stop  # the weights really moved back
    assert any(not np.array_equal(np.array(final[k]), np.array(last[k])) for k in final)


def test_a_metric_the_objective_does_not_report_is_refused_naming_the_key(
    tmp_path, data_dir, llama_dir
):
    with pytest.raises(UserInputError) as e:
        run(
            tmp_path,
            data_dir,
            llama_dir,
            "bad",
            {"patience": 2, "metric": "eval_reward"},
            eval={"every": 2, "at_start": True},
        )
    assert e.value.where == "train.early_stopping.metric" and "eval_ppl" in str(e.value)
