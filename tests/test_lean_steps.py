"""Lean steps: the loop queues each optimizer step without waiting for it and reads the steps'
results only at log steps (and where it needs them: evaluation, checkpoints, a stop, or a
callback that asks for a value)."""

import json

import pytest

from conftest import TIMING, Poison, tiny_recipe
from mlxtune import Callback, Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.errors import TrainingError

VALUES = ("loss", "grad_norm", "lr", "tokens_seen")


def make(data_dir, model_dir, run_dir, callbacks=(), **sections):
    r = tiny_recipe(data_dir, model_dir, **sections)
    tr = Trainer(
        recipe_from_dict(r), run_dir=run_dir, console=Console(quiet=True), callbacks=callbacks
    )
    reads = []
    inner = tr._read_steps

    def read():  # which queued steps each wait covered
        if tr._queued:
            reads.append([q.step for q in tr._queued])
        inner()

    tr._read_steps = read
    return tr, reads


class Reader(Callback):
    """Reads every value of every step (each read waits for its step)."""

    def __init__(self):
        self.seen = {}

    def on_step(self, trainer, event):
        self.seen[event.step] = {k: getattr(event, k) for k in VALUES}


def rows(tr):
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in tr.run_dir.read_jsonl("metrics.jsonl")
        if "grad_norm" in r
    ]


def test_steps_are_read_at_log_steps_only_and_a_reading_callback_sees_the_same(
    tmp_path, data_dir, llama_dir
):
    train = {"batch_size": 4, "max_steps": 10, "log_every": 4, "progress": False}
    kw = dict(train=train, eval={"every": None}, checkpoints={"save_final": False})
    lazy, lazy_reads = make(data_dir, llama_dir, tmp_path / "lazy", **kw)
    lazy.run()
    # the first step alone (it is timed with its compilation), then one wait per log row
    assert lazy_reads == [[1], [2, 3, 4], [5, 6, 7, 8], [9, 10]]

    reader = Reader()
    eager, eager_reads = make(data_dir, llama_dir, tmp_path / "eager", [reader], **kw)
    eager.run()
    assert eager_reads == [[s] for s in range(1, 11)]
    # the same numbers either way: reading changes when the host waits, not what is computed
    assert rows(lazy) == rows(eager)
    by_step = {r["step"]: r for r in rows(eager)}
    for s in (4, 8, 10):
        assert reader.seen[s]["grad_norm"] == by_step[s]["grad_norm"]
        assert reader.seen[s]["lr"] == by_step[s]["lr"]
        assert reader.seen[s]["tokens_seen"] == by_step[s]["tokens_seen"]
    assert reader.seen[10]["loss"] == eager.last_loss
    assert [reader.seen[s]["tokens_seen"] for s in range(1, 11)] == sorted(
        {reader.seen[s]["tokens_seen"] for s in range(1, 11)}
    )  # strictly increasing: every step trained on its tokens


def test_evaluation_and_checkpoints_read_the_steps_before_them(tmp_path, data_dir, llama_dir):
    kw = dict(
        train={"batch_size": 4, "max_steps": 6, "log_every": 6, "progress": False},
        eval={"every": 3},
        checkpoints={"every": 2, "save_final": False},
    )
    tr, reads = make(data_dir, llama_dir, tmp_path / "run", **kw)
    tr.run()
    assert reads == [[1], [2], [3], [4], [5, 6]]  # step 5 has no eval, checkpoint or row
    # the checkpoint of step 4 holds step 4's figures, as a run that reads every step sees them
    reader = Reader()
    eager, _ = make(data_dir, llama_dir, tmp_path / "eager", [reader], **kw)
    eager.run()
    state = json.loads((tr.run_dir.checkpoints / "step-000004" / "trainer_state.json").read_text())
    assert state["resume"]["tokens_seen"] == reader.seen[4]["tokens_seen"]
    assert state["loss"] == reader.seen[4]["loss"] and state["resume"]["last_loss"] == state["loss"]


def test_a_skipped_step_between_log_steps_is_found_and_named(tmp_path, data_dir, llama_dir):
    train = {"batch_size": 4, "max_steps": 8, "log_every": 4, "progress": False}
    tr, reads = make(
        data_dir,
        llama_dir,
        tmp_path / "skip",
        [Poison(at=5, until=6)],
        train=train,
        eval={"every": None},
        precision={"nonfinite": "skip"},
    )
    summary = tr.run()
    assert reads == [[1], [2, 3, 4], [5, 6, 7, 8]]
    assert "step 6: the loss became nan; update skipped" in (tmp_path / "skip/log.txt").read_text()
    last = rows(tr)[-1]
    assert last["skipped_steps"] == 1 and summary["steps"] == 8
    assert last["tokens_seen"] == summary["tokens_seen"]


class Keep(Callback):
    def __init__(self):
        self.events = {}

    def on_step(self, trainer, event):
        self.events[event.step] = event


def test_stop_names_the_first_bad_step_when_the_steps_are_read(tmp_path, data_dir, llama_dir):
    train = {"batch_size": 4, "max_steps": 12, "log_every": 4, "progress": False}
    keep = Keep()
    tr, _ = make(
        data_dir,
        llama_dir,
        tmp_path / "stop",
        [Poison(at=5), keep],
        train=train,
        eval={"every": None},
    )
    with pytest.raises(TrainingError, match=r"step 6: the loss became nan"):
        tr.run()
    # read at step 8, before its callbacks: steps 6-8 were not finite; nothing after step 8 ran
    assert [r["step"] for r in rows(tr)] == [4] and max(keep.events) == 7
    # every step read before the run stopped was accounted for, the ones after step 6 too
    assert not tr._queued
    assert keep.events[7].tokens_seen == keep.events[5].tokens_seen > 0
    assert not keep.events[7].grad_norm == keep.events[7].grad_norm  # NaN: not applied
