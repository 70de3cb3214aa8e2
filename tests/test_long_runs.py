"""Long runs that survive: a second signal ends a run at once even inside a long MLX
evaluation, with the last checkpoint intact and a message saying what was lost."""

import subprocess
import sys
import time

import yaml

from conftest import REPO, tiny_recipe
from mlxtune.checkpoint import verify

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
