"""One rank of a data-parallel run for tests/test_distributed.py, started by mlx.launch: trains a
recipe through ``mlxtune.Trainer``, interrupting itself with SIGINT or dying after a given step
when asked, and leaves its exit code (as the CLI's) in a folder, since mlx.launch exits 0
whatever its processes did."""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import mlxtune
from conftest import Poison
from mlxtune.errors import Interrupted


class Act(mlxtune.Callback):
    def __init__(self, rank, sigint_at, die_at, sleep_at=None, sleep_s=0.0):
        self.rank, self.sigint_at, self.die_at = rank, sigint_at, die_at
        self.sleep_at, self.sleep_s = sleep_at, sleep_s

    def on_step(self, trainer, event):
        if trainer.world.rank != self.rank:
            return
        if event.step == self.sleep_at:
            time.sleep(self.sleep_s)  # slow, and alive
        if event.step == self.sigint_at:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in this rank's terminal
        if event.step == self.die_at:
            os._exit(9)  # killed: no checkpoint, no goodbye


def run_out_of_memory(engine, at):
    """The engine's ``at``-th forward+backward raises MemoryError, as MLX does when an
    allocation fails."""
    calls = [0]
    real = engine._grad_step

    def grad_step(*args):
        calls[0] += 1
        if calls[0] == at:
            raise MemoryError("simulated: could not allocate")
        return real(*args)

    engine._grad_step = grad_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("run_dir")
    ap.add_argument("codes")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--sigint-at", type=int)
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--oom-at", type=int, help="the rank's Nth forward+backward runs out of memory")
    ap.add_argument("--nan-at", type=int, help="the rank's forward is NaN in this step only")
    ap.add_argument("--sleep-at", type=int, help="the rank sleeps --sleep-s after this step")
    ap.add_argument("--sleep-s", type=float, default=0.0)
    a = ap.parse_args()
    # mlx.launch stops the other ranks (SIGTERM) as soon as one exits non-zero: a rank that has
    # already left the training loop must still get to write its exit code (the trainer has its
    # own handler while it runs, and puts this one back after)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = 0
    try:
        trainer = mlxtune.Trainer(
            mlxtune.load_recipe(a.recipe),
            run_dir=a.run_dir,
            resume="latest" if a.resume else None,
            callbacks=[Act(a.rank, a.sigint_at, a.die_at, a.sleep_at, a.sleep_s)],
        )
        if a.nan_at and trainer.world.rank == a.rank:
            trainer.callbacks.append(Poison(a.nan_at - 1, a.nan_at))
        if a.oom_at and trainer.world.rank == a.rank:
            run_out_of_memory(trainer.engine, a.oom_at)
        trainer.run()
    except Interrupted as e:
        print(f"mlxtune: {e}", file=sys.stderr)
        code = 130
    except mlxtune.TrainingError as e:
        print(f"mlxtune: training failed: {e}", file=sys.stderr)
        code = 1
    # written whole or not at all: a rank killed while writing leaves no empty file
    done = Path(a.codes, f"rank-{os.environ.get('MLX_RANK', '0')}")
    done.with_suffix(".part").write_text(str(code))
    os.replace(done.with_suffix(".part"), done)
    sys.exit(code)


if __name__ == "__main__":
    main()
