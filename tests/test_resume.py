"""Exact resume: a run stopped at step k and resumed gives the metrics rows an uninterrupted run
gives; damaged checkpoints are skipped; recipe changes are listed or refused."""

import json

import mlx.core as mx
import pytest
import yaml

from conftest import make_crash, tiny_recipe
from conftest import run_rows as rows
from mlxtune import Callback, Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.errors import UserInputError
from mlxtune.runs.checkpoint import write_checksums

LORA = {"type": "lora", "rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj"]}


def recipe(data_dir, model_dir, adapter=LORA, **over):
    r = tiny_recipe(
        data_dir,
        model_dir,
        adapter=adapter,
        train={"batch_size": 8, "max_steps": 12, "log_every": 1, "progress": False, "seed": 3},
        eval={"every": 4},
        checkpoints={"every": 3, "keep_last": 5},
        **over,
    )
    return r


def trainer(r, run_dir, **kw):
    return Trainer(recipe_from_dict(r), run_dir=run_dir, console=Console(quiet=True), **kw)


@pytest.fixture
def reference(tmp_path, data_dir, llama_dir):
    r = recipe(data_dir, llama_dir)
    trainer(r, tmp_path / "whole").run()
    return r, rows(tmp_path / "whole")


def crashed(r, run_dir, at):
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(
            recipe_from_dict(r),
            run_dir=run_dir,
            console=Console(quiet=True),
            callbacks=[make_crash(at)],
        ).run()


def test_a_resumed_run_gives_the_same_metrics_as_an_uninterrupted_one(tmp_path, reference):
    r, want = reference
    crashed(r, tmp_path / "cut", at=7)  # checkpoints at 3 and 6; rows up to 7 written
    assert rows(tmp_path / "cut")[-1]["step"] == 7
    summary = trainer(r, tmp_path / "cut", resume="latest").run()
    assert summary["steps"] == 12
    assert rows(tmp_path / "cut") == want  # step 7's row is cut and replayed identically
    assert (
        "resumed from checkpoints/step-000006 at step 6"
        in (tmp_path / "cut" / "log.txt").read_text()
    )


def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tmp_path, reference):
    r, want = reference
    crashed(r, tmp_path / "cut", at=7)
    weights = tmp_path / "cut" / "checkpoints" / "step-000006" / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    trainer(r, tmp_path / "cut", resume="latest").run()
    log = (tmp_path / "cut" / "log.txt").read_text()
    assert (
        "skipping checkpoint step-000006: adapters.safetensors does not match its checksum" in log
    )
    # the newest intact one: the best-eval checkpoint saved at step 4's evaluation
    assert "resumed from checkpoints/best at step 4" in log
    assert rows(tmp_path / "cut") == want


def test_a_checkpoint_whose_recipe_predates_a_schema_section_resumes(tmp_path, reference):
    """Checkpoints written before the recipe had an objective section hold no such key: it
    counts at its default (sft), so they resume as they were."""
    r, want = reference
    crashed(r, tmp_path / "cut", at=7)
    ckpt = tmp_path / "cut" / "checkpoints" / "step-000006"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["recipe"].pop("objective") == {
        "type": "sft",
        "loss": "ce",
        "router_aux_loss_coef": 0.0,
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)
    trainer(r, tmp_path / "cut", resume="step-000006").run()
    assert rows(tmp_path / "cut") == want
    assert "objective" not in (tmp_path / "cut" / "log.txt").read_text()


def test_resume_from_a_named_checkpoint_and_extend_the_run(tmp_path, data_dir, llama_dir):
    r = recipe(data_dir, llama_dir)
    trainer(r, tmp_path / "run").run()
    longer = dict(r, train=dict(r["train"], max_steps=15))
    summary = trainer(longer, tmp_path / "run", resume="final").run()
    assert summary["steps"] == 15
    got = [row["step"] for row in rows(tmp_path / "run") if "loss" in row]
    assert got == list(range(1, 16))
    assert "train.max_steps: 12 -> 15" in (tmp_path / "run" / "log.txt").read_text()


def test_a_recipe_change_that_cannot_be_honoured_is_refused(tmp_path, data_dir, llama_dir, capsys):
    r = recipe(data_dir, llama_dir)
    crashed(r, tmp_path / "cut", at=4)
    before = (tmp_path / "cut" / "metrics.jsonl").read_text()
    p = tmp_path / "changed.yaml"
    p.write_text(yaml.safe_dump(dict(r, optimizer={"lr": 5e-2})))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "cut"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.lr: 0.01 -> 0.05" in err and "Traceback" not in err
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == before  # nothing touched


def test_resuming_a_finished_run_is_refused_and_touches_nothing(
    tmp_path, data_dir, llama_dir, capsys
):
    """--resume on a run already at its last step exits 2 naming the checkpoint; the run's
    metrics, summary and checkpoints stay as they were."""
    r = recipe(data_dir, llama_dir)
    r["train"]["max_steps"] = 3
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "done")]) == 0
    capsys.readouterr()
    files = sorted(f for f in (tmp_path / "done").rglob("*") if f.is_file())
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    assert main(["run", str(p), "--run-dir", str(tmp_path / "done"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "checkpoints/final: this checkpoint is at step 3 and the recipe ends at step 3" in err
    assert sorted(f for f in (tmp_path / "done").rglob("*") if f.is_file()) == files
    assert {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files} == before


def test_resume_needs_a_run_and_an_intact_checkpoint(tmp_path, data_dir, llama_dir):
    r = recipe(data_dir, llama_dir)
    with pytest.raises(UserInputError, match="no run to resume"):
        trainer(r, tmp_path / "empty", resume="latest")
    crashed(r, tmp_path / "cut", at=2)  # no checkpoint yet
    with pytest.raises(UserInputError, match="no checkpoint to resume from"):
        trainer(r, tmp_path / "cut", resume="latest")
    crashed(r, tmp_path / "cut2", at=4)
    (tmp_path / "cut2" / "checkpoints" / "step-000003" / "checksums.json").unlink()
    with pytest.raises(UserInputError, match="incomplete write"):
        trainer(r, tmp_path / "cut2", resume="step-000003")


@pytest.mark.parametrize(
    "name, damage",
    [
        ("trainer_state.json", lambda b: b"not json"),
        ("adapters.safetensors", lambda b: b[: len(b) // 2]),  # the header, half the data
    ],
)
def test_a_checkpoint_written_damaged_under_its_checksums_is_refused(
    tmp_path, data_dir, llama_dir, capsys, name, damage
):
    """A file that matches checksums.json but does not parse (a checkpoint copied or rewritten
    by hand) is named, exit 2, when export or --resume read it; never a traceback."""
    r = recipe(data_dir, llama_dir)
    r["train"]["max_steps"] = 2
    trainer(r, tmp_path / "run").run()
    final = tmp_path / "run" / "checkpoints" / "final"
    (final / name).write_bytes(damage((final / name).read_bytes()))
    (final / "checksums.json").unlink()
    write_checksums(final)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(dict(r, train=dict(r["train"], max_steps=4))))
    out = tmp_path / "out"
    for argv in (
        ["export", str(final), "--format", "mlx-lm", "--out", str(out)],
        ["run", str(p), "--run-dir", str(tmp_path / "run"), "--resume", "final"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert f"{final}: cannot " in err and f"{name} is damaged (it does not parse)" in err
    assert not out.exists()


class Signal(Callback):
    def __init__(self, at, times=1, sig=None):
        import signal

        self.at, self.times, self.sig = at, times, sig or signal.SIGINT

    def on_step(self, trainer, event):
        import os

        if event.step == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)


def test_a_signal_finishes_the_step_saves_and_the_run_resumes_exactly(tmp_path, reference):
    import signal

    from mlxtune.errors import Interrupted

    r, want = reference
    run = tmp_path / "sig"
    before = signal.getsignal(signal.SIGINT)
    t = Trainer(
        recipe_from_dict(r),
        run_dir=run,
        console=Console(quiet=True),
        callbacks=[Signal(5, sig=signal.SIGTERM)],
    )
    with pytest.raises(Interrupted, match=r"after step 5.*--resume"):
        t.run()
    assert signal.getsignal(signal.SIGINT) is before  # handlers put back
    assert (run / "checkpoints" / "step-000005" / "checksums.json").exists()
    assert rows(run)[-1]["step"] == 5
    trainer(r, run, resume="latest").run()
    assert rows(run) == want


def test_a_second_ctrl_c_stops_at_once(tmp_path, data_dir, llama_dir):
    r = recipe(data_dir, llama_dir)
    t = Trainer(
        recipe_from_dict(r),
        run_dir=tmp_path / "run",
        console=Console(quiet=True),
        callbacks=[Signal(2, times=2)],
    )
    with pytest.raises(KeyboardInterrupt):
        t.run()
    assert not (tmp_path / "run" / "checkpoints" / "step-000002").exists()


def test_the_cli_exits_130_and_says_how_to_resume(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    import mlxtune.loop as trainer_module

    r = recipe(data_dir, llama_dir)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r))
    real = trainer_module.Trainer.__init__

    def with_signal(self, *a, **kw):
        real(self, *a, **kw)
        self.callbacks.append(Signal(3))

    monkeypatch.setattr(trainer_module.Trainer, "__init__", with_signal)
    assert main(["run", str(p), "--run-dir", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert f"mlxtune run {p} --run-dir {tmp_path / 'run'} --resume" in err


@pytest.mark.parametrize(
    "optimizer, schedule, adapter",
    [
        pytest.param(  # suite time: adafactor's case covers WSD and a resumed state
            {"name": "lion", "lr": 3e-4, "weight_decay": 0.1},
            {"name": "warmup_stable_decay", "decay_fraction": 0.25},
            LORA,
            marks=pytest.mark.slow,
        ),
        (
            {"name": "adafactor", "lr": 1e-2, "adafactor": {"beta1": 0.9}},
            {"name": "warmup_stable_decay", "warmup_steps": 2, "decay_fraction": 0.4},
            LORA,
        ),
        (  # full: the blocks' matrices under Muon, the embedding and norms under AdamW
            {"name": "muon", "lr": 1e-3, "weight_decay": 0.1, "muon": {"nesterov": False}},
            {"name": "cosine", "warmup_steps": 2},
            {"type": "full"},
        ),
        (  # curvature drawn before steps 1, 4, 7, 10: the resumed run draws step 7's alike
            {"name": "sophia", "lr": 2e-3, "weight_decay": 0.1, "sophia": {"k": 3}},
            {"name": "linear"},
            LORA,
        ),
        (  # full: the embedding and the blocks' large matrices keep 8-bit moments
            {"name": "adamw8bit", "lr": 1e-3, "weight_decay": 0.1},
            {"name": "cosine"},
            {"type": "full"},
        ),
        pytest.param(  # suite time: sgd and adam keep one or two moments, as the others do
            {"name": "sgd", "lr": 5e-2, "momentum": 0.9, "weight_decay": 0.1},
            {"name": "linear"},
            LORA,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"name": "adam", "lr": 1e-2}, {"name": "cosine"}, LORA, marks=pytest.mark.slow
        ),
    ],
    ids=[
        "lion-wsd",
        "adafactor-momentum-wsd",
        "muon-full",
        "sophia-lora",
        "adamw8bit-full",
        "sgd-momentum",
        "adam",
    ],
)
def test_each_optimizer_resumes_exactly(
    tmp_path, data_dir, llama_dir, optimizer, schedule, adapter, monkeypatch
):
    """Its whole state (Lion's momentum; Adafactor's row and column moments, its first moment
    and its step count; Muon's momentum and AdamW's moments, two step counts; Sophia's
    momentum and curvature, and the random state its labels are drawn with) in the
    checkpoint: a run cut at step 7 and resumed writes the rows of one that was not, and the
    decay goes on where it was."""
    import mlxtune.engine.optim

    monkeypatch.setattr(
        mlxtune.engine.optim, "MIN_8BIT", 512
    )  # the tiny model's matrices are small
    r = recipe(data_dir, llama_dir, adapter, optimizer=optimizer, schedule=schedule)
    trainer(r, tmp_path / "whole").run()
    want = rows(tmp_path / "whole")
    crashed(r, tmp_path / "cut", at=7)
    trainer(r, tmp_path / "cut", resume="latest").run()
    assert rows(tmp_path / "cut") == want
    lrs = [x["lr"] for x in want if "lr" in x]
    assert len(set(lrs)) > 2 and lrs[-1] == pytest.approx(0.0, abs=1e-12)
    if optimizer["name"] == "adamw8bit":  # the resumed state held 8-bit codes
        saved = mx.load(str(tmp_path / "cut" / "checkpoints" / "final" / "optimizer.safetensors"))
        assert any(k.endswith(".m_q") and v.dtype == mx.int8 for k, v in saved.items())
