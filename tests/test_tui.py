"""The dashboard against a recorded run directory: data parsing, keys, read-only."""

import asyncio
import json

from textual.widgets import Sparkline, Static

from mlxtune.tui.app import WatchApp
from mlxtune.tui.rundata import Curve, RunData, ema


def recorded_run(path, steps=30, total=100, bad=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "control").mkdir(exist_ok=True)
    (path / "checkpoints" / "step-000020").mkdir(parents=True)
    (path / "config_resolved.json").write_text(
        json.dumps(
            {
                "recipe": {
                    "name": "demo",
                    "adapter": {"type": "lora", "rank": 8, "alpha": 16},
                    "optimizer": {"name": "adamw", "lr": 1e-3},
                    "schedule": {"name": "cosine"},
                    "train": {"batch_size": 4, "grad_accumulation": 1},
                },
                "model_dir": "models/base",
                "derived": {
                    "effective_steps": total,
                    "trainable_parameters": 1234,
                    "trainable_percent": 1.5,
                    "train_examples": 100,
                    "valid_examples": 10,
                },
            }
        )
    )
    lines = []
    for s in range(1, steps + 1):
        lines.append(
            json.dumps(
                {
                    "step": s,
                    "loss": 3.0 / s,
                    "lr": 1e-3,
                    "grad_norm": 0.5,
                    "tokens_per_sec": 1000.0,
                    "step_time_s": 0.1,
                    "peak_memory_gb": 0.2,
                    "tokens_seen": 100 * s,
                    "time": 1000.0 + s,
                }
            )
        )
        if s % 10 == 0:
            lines.append(
                json.dumps({"step": s, "eval_loss": 2.0 / s, "eval_ppl": 1.5, "time": 1000.0 + s})
            )
    if bad:
        lines.insert(5, "{not json")
        lines.append(
            json.dumps(
                {
                    "step": steps + 1,
                    "loss": None,
                    "lr": 1e-3,
                    "grad_norm": None,
                    "tokens_per_sec": 1.0,
                    "step_time_s": 0.1,
                    "peak_memory_gb": 0.2,
                    "tokens_seen": 1,
                    "time": 2000.0,
                }
            )
        )  # a NaN loss
    (path / "metrics.jsonl").write_text(
        "\n".join(lines) + "\n" + '{"step": 99, "loss": 1.'
    )  # a half-written last line
    (path / "samples.jsonl").write_text(
        json.dumps({"step": 20, "prompt": "reverse abc =", "completion": " cba"}) + "\n"
    )
    return path


def test_rundata_reads_whole_lines_skips_bad_ones_and_sees_appends(tmp_path):
    run = recorded_run(tmp_path / "run")
    d = RunData(run)
    assert d.poll()
    assert len(d.loss) == 31 and d.bad_lines == 1 and len(d.eval_loss) == 3
    assert d.last["step"] == 31 and d.total_steps == 100 and d.eta_s() == (100 - 31) * 0.1
    with open(run / "metrics.jsonl", "a") as f:
        f.write('23, "lr": 0.001}\n')  # the half-written line is finished
    assert d.poll() and d.last["step"] == 99
    assert not d.poll()


def test_curves_stay_bounded_over_long_runs():
    c = Curve(max_points=100)
    for i in range(100_000):
        c.add(i, 1.0 / (i + 1))
    assert len(c) <= 100 and c.xs[-1] == 99_999 and c.xs == sorted(c.xs)


def test_ema_is_bias_corrected_and_skips_nan():
    assert ema([2.0, 2.0, 2.0], 0.9) == [2.0, 2.0, 2.0]
    out = ema([1.0, float("nan"), 1.0], 0.5)
    assert out == [1.0, 1.0, 1.0]


def test_keys_send_requests_to_the_trainer(tmp_path):
    run = recorded_run(tmp_path / "run")

    async def drive():
        app = WatchApp(run, poll_s=0.05)
        async with app.run_test(size=(100, 40)) as pilot:
            await pilot.pause()
            header = str(app.query_one("#header", Static).render())
            assert "demo" in header and "lora r=8" in header
            assert "31/100" in str(app.query_one("#progress", Static).render())
            assert (
                len(app.query_one("#loss", Sparkline).data) == 31
            )  # the smoothed curve holds over the NaN
            assert "1 malformed" in str(app.query_one("#stats", Static).render())
            assert "NaN" in str(app.query_one("#loss-title", Static).render())
            for key in ("s", "e", "g", "p"):
                await pilot.press(key)
            assert {p.name for p in (run / "control").iterdir()} == {
                "save",
                "eval",
                "sample",
                "pause",
            }
            (run / "control" / "pause").unlink()
            await pilot.press("p")  # resume
            await pilot.press("q")
            assert {p.name for p in (run / "control").iterdir()} >= {"resume", "stop"}
            await pilot.press("6")
            assert not app.query_one("#log").display
            assert app.requests == ["save", "eval", "sample", "pause", "resume", "stop"]

    asyncio.run(drive())


def test_read_only_sends_nothing_and_small_terminals_work(tmp_path):
    run = recorded_run(tmp_path / "run", bad=False)

    async def drive():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            for key in ("s", "e", "g", "p", "q"):
                await pilot.press(key)
            assert not list((run / "control").iterdir())
            (run / "summary.json").write_text(
                json.dumps({"steps": 31, "final_loss": 0.1, "best_eval_loss": 0.07})
            )
            await pilot.pause(0.2)
            assert "finished: 31 steps" in str(app.query_one("#progress", Static).render())

    asyncio.run(drive())


def test_compare_prints_each_runs_figures_and_marks_the_best(tmp_path, capsys):
    from mlxtune.cli import main

    a = recorded_run(tmp_path / "a", steps=30)
    b = recorded_run(tmp_path / "b", steps=10, bad=False)
    (a / "summary.json").write_text(json.dumps({"steps": 31}))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    row_a, row_b = out[2], out[3]
    assert "31" in row_a and "yes *" in row_a  # eval 2/30 beats 2/10
    assert row_b.rstrip().endswith("running") and "0.2000" in row_b  # b's best eval: 2/10
    assert main(["compare", str(tmp_path)]) == 2
