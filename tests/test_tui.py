"""The dashboard against a recorded run directory: data parsing, keys, read-only."""

import asyncio
import json

import pytest
from textual.widgets import DataTable, Log, Static

from mlxtune.tui.app import WatchApp
from mlxtune.tui.plot import Plot
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


def test_the_samples_panel_shows_old_rows_and_new_ones_as_written(tmp_path):
    """A run from before prompt_text (its whole prompt under "prompt") shows as it did; a row
    appended with prompt_text shows its prompt, brackets as written, not the templated text."""
    run = recorded_run(tmp_path / "run")
    new_row = {
        "step": 30,
        "prompt": "what is [/INST] [b]?",
        "prompt_text": "<|im_start|>system\nbe kind<|im_end|>\n<|im_start|>user\n"
        "what is [/INST] [b]?<|im_end|>\n<|im_start|>assistant\n",
        "completion": "a tag",
    }

    async def drive():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            old = str(app.query_one("#sample", Static).render())
            with open(run / "samples.jsonl", "a") as f:
                f.write(json.dumps(new_row) + "\n")
            await pilot.pause(0.3)
            return old, str(app.query_one("#sample", Static).render())

    old, new = asyncio.run(drive())
    assert old == "sample @ 20: 'reverse abc =' → ' cba'"
    assert new == "sample @ 30: 'what is [/INST] [b]?' → 'a tag'"


def test_the_samples_panel_names_an_image_prompts_pictures(tmp_path):
    run = recorded_run(tmp_path / "run")
    row = {
        "step": 40,
        "prompt": "[image]colour?",
        "prompt_text": "...",
        "completion": "red",
        "images": [str(tmp_path / "img" / "valid3.png")],
    }
    with open(run / "samples.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")

    async def drive():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            return str(app.query_one("#sample", Static).render())

    assert asyncio.run(drive()) == "sample @ 40: '[image]colour?' → 'red' (images: valid3.png)"


def test_the_stats_line_shows_a_tool_runs_turns_calls_and_errors(tmp_path):
    run = recorded_run(tmp_path / "run", bad=False)
    row = {"step": 31, "loss": 0.1, "turns": 1.75, "tool_calls": 0.5, "tool_errors": 0.125}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")

    async def drive():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(200, 40)) as pilot:
            await pilot.pause()
            return str(app.query_one("#stats", Static).render())

    stats = asyncio.run(drive())
    assert "turns 1.75 · tool calls 0.50 (errors 0.12)" in stats, stats


def test_keys_send_requests_to_the_trainer(tmp_path):
    run = recorded_run(tmp_path / "run")

    async def drive():
        app = WatchApp(run, poll_s=0.05)
        async with app.run_test(size=(100, 40)) as pilot:
            await pilot.pause()
            header = str(app.query_one("#header", Static).render())
            assert "demo" in header and "lora r=8" in header
            assert "31/100" in str(app.query_one("#progress", Static).render())
            loss = app.query_one("#loss", Plot)
            names = [s[0] for s in loss.series]
            assert names == ["train", "smoothed", "eval"]
            train, smoothed, evals = loss.series
            assert len(train[1]) == 31 and len(evals[1]) == 3
            assert all(v == v for v in smoothed[2])  # the smoothed curve holds over the NaN
            assert "1 malformed" in str(app.query_one("#stats", Static).render())
            assert "loss NaN" in loss.title and "eval 0.0667" in loss.title
            assert "grad norm NaN" in app.query_one("#gnorm", Plot).title
            await pilot.press("right_square_bracket")
            assert app.smoothing == 0.8 and "(ema 0.8)" in loss.title
            await pilot.press("left_square_bracket", "left_square_bracket", "left_square_bracket")
            assert app.smoothing == 0.0
            assert loss.series[1][2][:3] == loss.series[0][2][:3]  # no smoothing: the raw curve
            await pilot.press("l")  # the loss axis in log scale, and back
            assert loss.log_y and "log scale" in loss.title
            await pilot.press("l")
            assert not loss.log_y and "log scale" not in loss.title
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
    # two runs of one recipe: each named by its folder, the recipe's name beside it
    assert row_a.startswith("a (demo)") and row_b.startswith("b (demo)")
    assert "31" in row_a and "0.0667 *" in row_a and "yes" in row_a  # eval 2/30 beats 2/10
    assert row_b.rstrip().endswith("running") and "0.2000" in row_b  # b's best eval: 2/10
    assert main(["compare", str(tmp_path)]) == 2


def test_log_pane_follows_the_runs_log_and_the_side_plots_fold_on_small_terminals(tmp_path):
    run = recorded_run(tmp_path / "run", bad=False)
    (run / "log.txt").write_text("2026-11-22 10:00:00 loaded models/base\n")

    async def drive():
        app = WatchApp(run, poll_s=0.05)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.2)
            assert not app.query_one("#side").display  # 80 columns: the loss plot alone
            with open(run / "log.txt", "a") as f:
                f.write("2026-11-22 10:00:05 WARNING: 3 examples dropped\n")
            await pilot.pause(0.3)
            text = "\n".join(app.query_one("#log", Log).lines)
            assert "loaded models/base" in text and "3 examples dropped" in text
            await pilot.press("2")  # asks for the learning-rate plot: it comes, alone
            assert app.query_one("#side").display and app.query_one("#lr").display
            assert not app.query_one("#gnorm").display
        app = WatchApp(run, poll_s=0.05)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.2)
            assert app.query_one("#side").display

    asyncio.run(drive())


def test_a_long_run_keeps_the_plot_bounded(tmp_path):
    run = recorded_run(tmp_path / "run", steps=0, bad=False)
    rows = [
        json.dumps({"step": s, "loss": 1.0 + 1 / s, "lr": 1e-3, "grad_norm": 1.0, "time": s})
        for s in range(1, 100_001)
    ]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")

    async def drive():
        app = WatchApp(run, poll_s=0.05)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause(0.2)
            train = app.query_one("#loss", Plot).series[0]
            assert len(train[1]) <= 2000 and train[1][-1] == 100_000

    asyncio.run(drive())


def test_compare_overlays_the_runs_by_step_or_tokens(tmp_path):
    from mlxtune.tui.compare import CompareApp

    a = recorded_run(tmp_path / "a", steps=30, bad=False)
    b = recorded_run(tmp_path / "b", steps=10, bad=False)

    async def drive():
        app = CompareApp([a, b], poll_s=0.05)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            plot = app.query_one("#overlay", Plot)
            lines = [s for s in plot.series if s[3] == "line"]
            assert [len(s[1]) for s in lines] == [30, 10] and lines[0][1][-1] == 30
            assert app.query_one("#table", DataTable).row_count == 2
            await pilot.press("t")
            assert plot.x_label == "tokens seen"
            lines = [s for s in plot.series if s[3] == "line"]
            assert lines[0][1][-1] == 3000  # 100 tokens a step
            await pilot.press("q")

    asyncio.run(drive())


@pytest.mark.parametrize("size", [(80, 24), (140, 40)])
def test_snapshots_of_the_dashboard(tmp_path, snap_compare, size):
    run = recorded_run(tmp_path / "demo")
    assert snap_compare(WatchApp(run, poll_s=60), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (140, 40)])
def test_snapshots_of_compare(tmp_path, snap_compare, size):
    from mlxtune.tui.compare import CompareApp

    a = recorded_run(tmp_path / "a", steps=30, bad=False)
    b = recorded_run(tmp_path / "b", steps=12, bad=False)
    assert snap_compare(CompareApp([a, b], poll_s=60), terminal_size=size)


def test_run_tui_trains_a_real_run_behind_the_dashboard(tmp_path):
    """mlxtune run --tui on a short cut of quickstart-lora: the dashboard follows the run live,
    its s key saves a checkpoint mid-run, and q closes it once training has ended."""
    from pathlib import Path

    from mlxtune.config import load_recipe
    from mlxtune.tui.live import run_with_dashboard

    repo = Path(__file__).resolve().parents[1]
    recipe = load_recipe(
        repo / "recipes" / "quickstart-lora.yaml",
        [
            "train.max_steps=40",
            "train.log_every=5",
            "eval.every=20",
            "eval.exact_match=0",
            "samples.every=20",
            "export.formats=[]",
        ],
    )
    seen = {}

    class Driven:
        def __init__(self, path, training):
            self.app = WatchApp(path, training=training, poll_s=0.05)
            self.training = training

        def run(self):
            async def drive():
                async with self.app.run_test(size=(120, 36)) as pilot:
                    await pilot.press("s")
                    for _ in range(1500):
                        await pilot.pause(0.1)
                        if not self.training.is_alive():
                            break
                    await pilot.pause(0.3)
                    loss = self.app.query_one("#loss", Plot)
                    seen["train points"] = len(loss.series[0][1])
                    seen["eval points"] = len(loss.series[2][1])
                    seen["log"] = "\n".join(self.app.query_one("#log", Log).lines)
                    seen["checkpoints"] = str(self.app.query_one("#checkpoints", Static).render())
                    await pilot.press("q")  # the run has ended: q closes the dashboard
                    seen["closed"] = not self.app.is_running

            asyncio.run(drive())

    summary = run_with_dashboard(recipe, tmp_path / "run", app_factory=Driven)
    assert summary["steps"] == 40
    assert seen["train points"] == 8 and seen["eval points"] == 2
    assert "asked the trainer to save" in seen["log"] and "training finished" in seen["log"]
    assert "loaded" in seen["log"]  # the trainer's own log.txt, followed live
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert len(saved) >= 2 and "final" in " ".join(saved)  # the one asked for, and the last
    assert seen["closed"]


def test_run_tui_reports_bad_input_before_the_dashboard_opens(tmp_path, capsys):
    from pathlib import Path

    from mlxtune.cli import main

    repo = Path(__file__).resolve().parents[1]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text("{}\n")
    recipe = str(repo / "recipes" / "quickstart-lora.yaml")
    assert main(["run", recipe, "--tui", "--run-dir", str(taken)]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_number_keys_toggle_every_panel_and_help_shows_the_keys(tmp_path):
    run = recorded_run(tmp_path / "run", bad=False)

    async def drive():
        app = WatchApp(run, poll_s=0.05)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.2)
            panels = ["#loss", "#lr", "#gnorm", "#stats", "#sample", "#log"]
            for n, sel in enumerate(panels, start=1):
                assert app.query_one(sel).display
                await pilot.press(str(n))
                assert not app.query_one(sel).display, sel
            assert not app.query_one("#side").display  # both of its plots are hidden
            assert not app.query_one("#checkpoints").display  # 5 hides sample and checkpoints
            await pilot.press("1")
            assert app.query_one("#loss").display
            await pilot.press("question_mark")
            await pilot.pause()
            shown = [n.message for n in app._notifications]
            assert any("[ ] less/more smoothing" in m and "ctrl+q" in m for m in shown)
            assert any("l log/linear loss axis" in m for m in shown)

    asyncio.run(drive())


def preference_run(path, steps=20):
    """A recorded DPO run: rows with TRL's reward names, eval rows with them too."""
    recorded_run(path, steps=0, bad=False)
    lines = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 0.7 / s, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 900.0}
        row.update({"step_time_s": 0.1, "peak_memory_gb": 0.1, "tokens_seen": 50 * s})
        row.update({"rewards/margins": 0.1 * s, "rewards/accuracies": min(1.0, 0.5 + 0.03 * s)})
        lines.append(json.dumps(row))
        if s % 5 == 0:
            lines.append(
                json.dumps(
                    {
                        "step": s,
                        "eval_loss": 0.6 / s,
                        "eval_rewards/margins": 0.09 * s,
                        "eval_rewards/accuracies": 0.4 + 0.03 * s,
                    }
                )
            )
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_preference_runs_plot_margins_and_accuracy_beside_the_loss(tmp_path):
    from mlxtune.tui.compare import CompareApp

    run = preference_run(tmp_path / "dpo")
    sft = recorded_run(tmp_path / "sft", steps=10, bad=False)

    async def watch():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.2)
            assert app.query_one("#prefs").display
            margins = app.query_one("#margins", Plot)
            train, evals = margins.series
            assert train[2][-1] == pytest.approx(ema([0.1 * s for s in range(1, 21)], 0.6)[-1])
            assert evals[1] == [5, 10, 15, 20] and evals[2][-1] == pytest.approx(1.8)
            acc = app.query_one("#accuracy", Plot)
            assert "eval 100.0%" in acc.title and acc.series[1][2][0] == pytest.approx(0.55)
            assert "ppl" not in app.query_one("#loss", Plot).title
            await pilot.press("7")  # the panel's key hides and shows it
            assert not app.query_one("#prefs").display
            await pilot.press("7")
            assert app.query_one("#prefs").display
        app = WatchApp(sft, read_only=True, poll_s=0.05)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.2)
            assert not app.query_one("#prefs").display  # an SFT run has none

    async def compare():
        app = CompareApp([run, sft], poll_s=0.05)
        async with app.run_test(size=(140, 48)) as pilot:
            await pilot.pause(0.2)
            assert app.query_one("#prefs").display
            series = app.query_one("#accuracy", Plot).series
            # both runs are named demo: told apart by their folders; the SFT run has no curve
            assert [s[0] for s in series] == ["dpo (demo)", "dpo (demo) eval"]
            await pilot.press("t")
            assert app.query_one("#margins", Plot).series[0][1][-1] == 1000  # tokens seen

    asyncio.run(watch())
    asyncio.run(compare())


def grpo_run(path, steps=12):
    """A recorded GRPO run: rows with the rollout's reward and completion length, eval rows with
    the held-out reward (its loss the negative reward) and a sample completion."""
    recorded_run(path, steps=0, bad=False)
    lines = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 0.01, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 900.0}
        row.update({"step_time_s": 0.1, "peak_memory_gb": 0.1, "tokens_seen": 40 * s})
        row.update({"reward": 0.05 * s, "completion_length": 10.0 - 0.5 * s})
        lines.append(json.dumps(row))
        if s % 4 == 0:
            r = 0.06 * s
            lines.append(
                json.dumps(
                    {"step": s, "eval_loss": -r, "eval_reward": r, "eval_completion_length": 6.0}
                )
            )
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    sample = {"step": 12, "eval": True, "prompt": "copy ab =", "completion": "ab", "reward": 1.0}
    (path / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    return path


def test_grpo_runs_plot_reward_and_length_beside_the_loss(tmp_path):
    from mlxtune.tui.compare import CompareApp

    run = grpo_run(tmp_path / "grpo")
    dpo = preference_run(tmp_path / "dpo")

    async def watch():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.2)
            assert app.query_one("#prefs").display
            reward = app.query_one("#margins", Plot)
            train, evals = reward.series
            assert train[2][-1] == pytest.approx(ema([0.05 * s for s in range(1, 13)], 0.6)[-1])
            assert evals[1] == [4, 8, 12] and evals[2][-1] == pytest.approx(0.72)
            assert reward.title.startswith("reward 0.600") and "eval 0.720" in reward.title
            length = app.query_one("#accuracy", Plot)
            assert length.title.startswith("completion length 4.0")
            assert "'copy ab =' → 'ab'" in str(app.query_one("#sample").render())

    async def compare():
        app = CompareApp([run, dpo], poll_s=0.05)
        async with app.run_test(size=(140, 48)) as pilot:
            await pilot.pause(0.2)
            series = app.query_one("#margins", Plot).series
            assert [s[0] for s in series] == [
                "grpo (demo)",
                "grpo (demo) eval",
            ]  # the DPO run plots other kinds

    asyncio.run(watch())
    asyncio.run(compare())


def test_the_end_screen_puts_the_trained_model_beside_its_base(tmp_path):
    """From the run's own records: its evaluation before the first step and at the end, its
    exact match before and after."""
    run = recorded_run(tmp_path / "run", bad=False)
    metrics = run / "metrics.jsonl"
    first = json.dumps({"step": 0, "eval_loss": 4.25, "eval_ppl": 70.1, "time": 999.0})
    metrics.write_text(first + "\n" + metrics.read_text())
    summary = {"steps": 30, "final_loss": 0.1, "best_eval_loss": 0.07, "final_eval_loss": 0.0667}
    summary.update(exact_match_before=0.0, exact_match_after=0.9)
    (run / "summary.json").write_text(json.dumps(summary))

    async def drive():
        app = WatchApp(run, read_only=True, poll_s=60)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            text = str(app.query_one("#progress", Static).render())
            assert "base → trained: eval loss 4.2500 → 0.0667, exact match 0.0% → 90.0%" in text

    asyncio.run(drive())
