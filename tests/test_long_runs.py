"""Long runs that survive: a second signal ends a run at once even inside a long MLX
evaluation, with the last checkpoint intact and a message saying what was lost."""

import subprocess
import sys
import time

import yaml

from conftest import REPO, tiny_recipe
from mlxtune.runs.checkpoint import verify

LONG_EVAL = """
import os, signal, sys, threading, time
import mlx.core as mx
import mlxtune
from mlxtune.console import Console


class Stuck(mlxtune.Callback):
    # after step 3: two SIGINTs arrive while the main thread is inside one long evaluation
    def on_step(self, trainer, event):
        if event.step != 3:
            return

        def send():
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=send, daemon=True).start()
        a = mx.random.normal((1200, 1200))
        x = a
        for _ in range(600):
            x = (x @ a) * 1e-3
        print("long evaluation started", flush=True)
        mx.eval(x)
        print("long evaluation returned", flush=True)


t = mlxtune.Trainer(
    mlxtune.load_recipe(sys.argv[1]), run_dir=sys.argv[2], console=Console(quiet=True),
    callbacks=[Stuck()],
)
t.run()
"""


def test_a_second_signal_inside_a_long_evaluation_stops_at_once(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 12, "log_every": 1, "progress": False},
        checkpoints={"every": 2},
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(r))
    script = tmp_path / "stuck.py"
    script.write_text(LONG_EVAL)
    run = tmp_path / "run"
    start = time.perf_counter()
    p = subprocess.run(
        [sys.executable, str(script), str(recipe), str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    took = time.perf_counter() - start
    assert p.returncode == 130, p.stdout + p.stderr
    assert "long evaluation started" in p.stdout
    assert "long evaluation returned" not in p.stdout  # ended inside it, not after
    assert (
        "stopped at once by a second signal while step 4 ran: the steps after the last "
        "checkpoint (checkpoints/step-000002) are lost" in p.stderr
    )
    assert f"mlxtune run {recipe} --run-dir {run} --resume" in p.stderr
    assert "stopped at once" in (run / "log.txt").read_text()
    assert verify(run / "checkpoints" / "step-000002") is None  # intact
    assert took < 60, took


def test_when_a_waiting_rank_gives_up_on_the_others():
    """``silence``: with marks of life, a rank unmarked for STALE_S is given up on once the
    wait is as long; ranks seen alive are waited for up to 4 x the limit; without marks the
    limit decides, every other rank a suspect."""
    from mlxtune.distributed import STALE_S, silence

    now = 1000.0
    alive = {0: now - 0.5, 1: now - 0.5, 2: now - 1.0}
    frozen = {**alive, 2: now - STALE_S - 1}
    assert silence(STALE_S + 1, 300, frozen, now, 0, 3) == (True, [2])
    assert silence(STALE_S - 1, 300, frozen, now, 0, 3) == (False, [1, 2])  # not yet
    assert silence(1000, 300, alive, now, 0, 3) == (False, [1, 2])  # alive: waited for
    assert silence(1201, 300, alive, now, 0, 3) == (True, [1, 2])  # but not forever
    missing = {0: now, 1: now}  # rank 2 has not marked itself yet (still setting up)
    assert silence(60, 300, missing, now, 0, 3)[0] is False
    assert silence(299, 300, None, now, 1, 2) == (False, [0])
    assert silence(301, 300, None, now, 1, 2) == (True, [0])


def test_auto_waits_twenty_times_the_longest_wait_and_at_least_five_minutes():
    from mlxtune.distributed import TIMEOUT_FLOOR_S, Watchdog, World

    w = Watchdog(World(0, 2), "auto", context=lambda: (0, "", ""))
    assert w.limit == TIMEOUT_FLOOR_S == 300
    w.longest = 40.0
    assert w.limit == 800
    assert Watchdog(World(0, 2), 12, context=None).limit == 12
    w.longest = 0.0
    with w.waiting("a step"):
        with w.waiting("nested"):  # the outer wait is the one timed
            time.sleep(0.05)
        time.sleep(0.05)
    assert 0.1 <= w.longest < 1.0


def test_memory_policy_decisions():
    """The wired limit (Metal only, its recommended working set), when the cache is freed, the
    warning for memory that creeps, and what Metal's resource limit is said to mean."""
    from mlxtune.engine.memory import (
        GB,
        creeping,
        resource_limit_note,
        should_clear_cache,
        wired_limit,
    )

    info = {"max_recommended_working_set_size": 22 * 2**30, "memory_size": 32 * 2**30}
    assert wired_limit(info, metal=True) == 22 * 2**30
    assert wired_limit(info, metal=False) is None and wired_limit({}, metal=True) is None
    assert [should_clear_cache(s, 0, 3, None) for s in range(1, 7)] == [0, 0, 1, 0, 0, 1]
    assert should_clear_cache(1, 2.1 * GB, None, 2.0) and not should_clear_cache(
        1, 1.9 * GB, None, 2.0
    )
    assert not should_clear_cache(5, 10 * GB, None, None)
    flat = [(100 * i, 1.00 * GB) for i in range(1, 6)]
    assert creeping(flat) is None
    rising = [(100, 1.0 * GB), (200, 1.03 * GB), (300, 1.06 * GB), (400, 1.1 * GB)]
    msg = creeping(rising)
    assert "1.00 -> 1.10 GB from step 100 to 400 (+10%)" in msg
    assert creeping(rising[:3]) is None  # too few samples
    assert creeping([(1, 1.0 * GB), (2, 1.01 * GB), (3, 1.02 * GB), (4, 1.03 * GB)]) is None  # +3%
    assert creeping([*rising[:3], (400, 1.05 * GB)]) is None  # not rising at each
    metal = RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")
    assert "number of live buffers" in resource_limit_note(metal)
    assert resource_limit_note(RuntimeError("[metal::malloc] Unable to allocate 4 GB")) is None


def test_rows_show_active_and_cache_memory_and_the_cache_is_freed_as_asked(
    tmp_path, data_dir, llama_dir
):
    """Run for real on the CPU: each metrics row carries active and cache memory; with
    memory.clear_cache_every: 2 the cache is empty after every second step (freed after the
    step's results are read: a few bytes released since), and holds the step's freed buffers
    after the others and in a run without it."""
    import json

    import mlx.core as mx

    import mlxtune
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    seen = {}

    class Cache(mlxtune.Callback):
        def on_step(self, trainer, event):
            seen[event.step] = mx.get_cache_memory()

    def run(name, memory):
        r = tiny_recipe(
            data_dir,
            llama_dir,
            train={"batch_size": 8, "max_steps": 6, "log_every": 1, "progress": False},
            memory=memory,
        )
        seen.clear()
        t = Trainer(recipe_from_dict(r), run_dir=tmp_path / name, console=Console(quiet=True),
                    callbacks=[Cache()])  # fmt: skip
        t.run()
        return dict(seen), [
            json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]

    cleared, rows = run("cleared", {"clear_cache_every": 2})
    steps = [r for r in rows if "loss" in r]
    assert all(r["active_memory_gb"] > 0 and r["cache_memory_gb"] >= 0 for r in steps)
    # freed: a few bytes released since (a scalar), against the step's buffers otherwise
    held = min(cleared[s] for s in (1, 3, 5))
    assert all(cleared[s] < held / 100 for s in (2, 4, 6)), cleared
    kept, _ = run("kept", {})
    assert all(kept[s] > held / 2 for s in range(1, 7)), kept


def test_memory_that_creeps_across_checkpoints_is_warned_of_once(tmp_path, data_dir, llama_dir):
    """A callback that keeps 4 MB of arrays a step (a leak a long run meets): active memory
    grows at each checkpoint, and the log warns once, naming the growth."""
    import mlx.core as mx

    import mlxtune
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    kept = []

    class Leak(mlxtune.Callback):
        def on_step(self, trainer, event):
            kept.append(mx.ones((1 << 20,), dtype=mx.float32) * event.step)
            mx.eval(kept[-1])

    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 8, "log_every": 4, "progress": False},
        checkpoints={"every": 1, "keep_last": 2},
    )
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True),
            callbacks=[Leak()]).run()  # fmt: skip
    log = (tmp_path / "run" / "log.txt").read_text()
    assert log.count("WARNING: active memory grew at each of the last 4 checkpoints") == 1
    r["checkpoints"]["every"] = 1
    kept.clear()
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "clean", console=Console(quiet=True)).run()
    assert "active memory grew" not in (tmp_path / "clean" / "log.txt").read_text()


def _disk_recipe(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 6, "log_every": 1, "progress": False},
        checkpoints={"every": 2, "keep_last": 3, "save_best": False},
    )
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    return r, path


def _after_a_failed_write(run, path, err, what):
    """What a run that could not write leaves: one line saying what, why, what is intact and
    how to go on; the step-2 checkpoint valid; no half-written folder; and it resumes."""
    from mlxtune.cli import main

    lines = [x for x in err.splitlines() if x.startswith("mlxtune:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"could not write {what} at step 4 (" in lines[0]
    assert "the last checkpoint (checkpoints/step-000002) is intact" in lines[0]
    assert f"continue with: mlxtune run {path} --run-dir {run} --resume" in lines[0]
    assert verify(run / "checkpoints" / "step-000002") is None
    assert not (run / "checkpoints" / "step-000004").exists()
    assert not [p for p in run.rglob("*.tmp")]  # nothing half-written left behind
    assert main(["run", str(path), "--run-dir", str(run), "--resume"]) == 0
    assert verify(run / "checkpoints" / "final") is None


def test_a_checkpoint_that_cannot_be_written_ends_the_run_with_one_line(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    """The write fails part-way (injected: no space left while the checkpoint's checksums are
    written, after its weights were)."""
    import errno

    import mlxtune.runs.checkpoint as ck
    from mlxtune.cli import main

    _, path = _disk_recipe(tmp_path, data_dir, llama_dir)
    run = tmp_path / "run"
    real = ck.write_checksums

    def full(folder):
        if "step-000004" in str(folder):
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "checksums.json"))
        return real(folder)

    monkeypatch.setattr(ck, "write_checksums", full)
    assert main(["run", str(path), "--run-dir", str(run)]) == 1
    monkeypatch.setattr(ck, "write_checksums", real)
    _after_a_failed_write(run, path, capsys.readouterr().err, "checkpoints/step-000004")


def test_a_full_disk_ends_the_run_with_one_line(tmp_path, data_dir, llama_dir):
    """On a real 4 MB filesystem (tmpfs, where this machine lets the test mount one): after
    step 2's checkpoint the disk fills up but for 12 KB, enough for the log and metrics lines
    and not for step 4's checkpoint, which MLX's writer fails to write."""
    import os
    import shutil

    import pytest

    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a small filesystem here")
    try:
        _, path = _disk_recipe(tmp_path, data_dir, llama_dir)
        run = disk / "run"
        script = tmp_path / "fill.py"
        script.write_text(FILL.format(disk=str(disk)))
        p = subprocess.run(
            [sys.executable, str(script), str(path), str(run)],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        assert p.returncode == 1, p.stdout + p.stderr
        (disk / "filler").unlink()
        _after_a_failed_write(run, path, p.stderr, "checkpoints/step-000004")
        assert shutil.disk_usage(disk).free > 0
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


FILL = """
import os, sys
import mlxtune
from mlxtune.cli import main


class Fill(mlxtune.Callback):
    def on_step(self, trainer, event):
        if event.step == 3:
            free = os.statvfs({disk!r})
            with open(os.path.join({disk!r}, "filler"), "wb") as f:
                f.write(b"0" * max(0, free.f_bavail * free.f_frsize - 12 * 1024))


real = mlxtune.Trainer.__init__


def with_fill(self, *a, **kw):
    real(self, *a, **kw)
    self.callbacks.append(Fill())


mlxtune.Trainer.__init__ = with_fill  # the class the CLI builds
sys.exit(main(["run", sys.argv[1], "--run-dir", sys.argv[2]]))
"""


def test_an_export_that_cannot_be_written_keeps_the_final_checkpoint(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    import errno

    import mlxtune.loop.ending as ending
    from mlxtune.cli import main

    r, path = _disk_recipe(tmp_path, data_dir, llama_dir)
    r["export"] = {"formats": ["mlx-lm"]}
    path.write_text(yaml.safe_dump(r))
    run = tmp_path / "run"

    def full(trained, fmt, folder, dtype):
        (folder / "adapters.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ending, "export", full)
    assert main(["run", str(path), "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err
    assert "could not write export/mlx-lm at step 6 (No space left on device" in err
    assert "the last checkpoint (checkpoints/step-000006) is intact" in err
    assert verify(run / "checkpoints" / "final") is None
    assert not (run / "export" / "mlx-lm").exists() and not list(run.rglob("*.tmp"))
