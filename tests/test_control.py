"""Steering a running trainer through RUN_DIR/control/, as the dashboard does."""

import threading
import time

import pytest

from conftest import tiny_recipe
from mlxtune import Callback, Trainer, recipe_from_dict
from mlxtune.loop.control import request, take_requests


def test_requests_are_taken_once(tmp_path):
    request(tmp_path, "save")
    request(tmp_path, "stop")
    assert take_requests(tmp_path) == {"save", "stop"}
    assert take_requests(tmp_path) == set()
    with pytest.raises(ValueError, match="unknown request"):
        request(tmp_path, "explode")


def test_save_eval_sample_and_stop_requests_steer_the_run(tmp_path, data_dir, llama_dir):
    class Asker(Callback):
        def on_step(self, trainer, event):
            if event.step == 2:
                for what in ("save", "eval", "sample"):
                    request(trainer.run_dir.path, what)
            if event.step == 4:
                request(trainer.run_dir.path, "stop")

    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 50, "log_every": 1, "progress": False},
    )
    r["eval"] = {"every": None}
    tr = Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", callbacks=[Asker()])
    summary = tr.run()
    assert summary["steps"] == 4
    rd = tr.run_dir
    assert (rd.path / "checkpoints" / "step-000002").exists()
    assert [row["step"] for row in rd.read_jsonl("metrics.jsonl") if "eval_loss" in row] == [2, 4]
    assert {row["step"] for row in rd.read_jsonl("samples.jsonl")} == {
        2
    }  # asked for; none scheduled
    assert not list((rd.path / "control").iterdir())


def test_pause_waits_until_resume(tmp_path, data_dir, llama_dir):
    steps = []

    class Pauser(Callback):
        def on_step(self, trainer, event):
            steps.append((event.step, time.monotonic()))
            if event.step == 1:
                request(trainer.run_dir.path, "pause")
                threading.Timer(1.0, request, (trainer.run_dir.path, "resume")).start()

    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 3, "log_every": 1, "progress": False},
    )
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", callbacks=[Pauser()]).run()
    assert [s for s, _ in steps] == [1, 2, 3]
    assert steps[1][1] - steps[0][1] >= 0.9  # step 2 waited for the resume
