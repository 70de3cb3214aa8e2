"""mlxtune eval RUN_DIR --base: the trained model beside its base, checked against what the run
itself recorded (its evaluation before the first step and at the end, its exact match before
and after), writing nothing."""

import json

import pytest

from conftest import tiny_arch, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console


def files(run):
    return {str(p): p.stat().st_mtime_ns for p in sorted(run.rglob("*")) if p.is_file()}


def test_eval_puts_the_trained_model_beside_its_base(tmp_path, data_dir, llama_dir, capsys):
    r = tiny_recipe(
        data_dir,
        llama_dir,
        optimizer={"lr": 5e-2},
        train={"batch_size": 8, "max_steps": 6, "log_every": 1, "progress": False},
        eval={"every": None, "at_start": True, "exact_match": 6, "max_new_tokens": 6},
    )
    run = tmp_path / "run"
    summary = Trainer(recipe_from_dict(r), run_dir=run, console=Console(quiet=True)).run()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in rows if "eval_loss" in x]
    before = files(run)
    assert main(["eval", str(run), "--base", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["checkpoint"] == "final" and list(got["models"]) == ["base", "trained"]
    base, trained = got["models"]["base"], got["models"]["trained"]
    # the run's own evaluations: before the first step (the adapters start as nothing), and last
    assert base["eval_loss"] == pytest.approx(evals[0]["eval_loss"], rel=1e-5)
    assert trained["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    assert trained["eval_loss"] < base["eval_loss"]
    assert base["exact_match"] == summary["exact_match_before"]
    assert trained["exact_match"] == summary["exact_match_after"]
    assert base["exact_match_examples"] == 6 and len(got["answers"]) == 3
    assert {"prompt", "reference", "base", "trained"} <= set(got["answers"][0])
    assert files(run) == before  # nothing written
    assert main(["eval", str(run)]) == 0
    text = capsys.readouterr().out
    assert "eval_loss" in text and "trained" in text and "base" not in text.split("\n")[2]


def test_a_run_from_scratch_has_no_base(tmp_path, data_dir, capsys):
    r = tiny_recipe(
        data_dir,
        None,
        model={"arch": tiny_arch("llama")},
        tokenizer={"train": {"vocab_size": 40, "model_type": "char"}},
        adapter={"type": "full"},
        train={"batch_size": 8, "max_steps": 2, "log_every": 1, "progress": False},
    )
    run = tmp_path / "scratch"
    Trainer(recipe_from_dict(r), run_dir=run, console=Console(quiet=True)).run()
    assert main(["eval", str(run), "--base"]) == 2
    assert "from scratch" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2  # not a run
