"""mlxtune run --tui: training on a worker thread with the dashboard in front.

The trainer is built and run entirely on the worker thread, so all MLX state lives there; the
dashboard on the main thread only reads the run directory and writes control requests, exactly
as ``mlxtune watch`` does from another terminal. Closing the dashboard with ctrl+q leaves
training running (the command then waits for it); q asks the trainer to stop gracefully.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from mlxtune.console import Console
from mlxtune.loop import Trainer
from mlxtune.loop.control import request
from mlxtune.runs.rundir import run_dir_for

from .app import WatchApp


class TrainingThread(threading.Thread):
    """Builds a Trainer for the recipe and runs it; keeps the summary or the exception."""

    def __init__(self, recipe, run_dir: Path, resume: str | None = None):
        super().__init__(name="mlxtune-train")
        self.recipe = recipe
        self.run_dir = run_dir
        self.resume = resume
        self.summary: dict | None = None
        self.exception: BaseException | None = None
        self.built = False  # the trainer was built: an exception after this is from training
        self.ready = threading.Event()  # set once the trainer is built (or failed to be)

    @property
    def error(self) -> str | None:
        return None if self.exception is None else str(self.exception)

    def run(self) -> None:
        try:
            trainer = Trainer(
                self.recipe, run_dir=self.run_dir, console=Console(quiet=True), resume=self.resume
            )
            self.built = True
            self.ready.set()
            self.summary = trainer.run()
        except BaseException as e:  # handed to the main thread, which reports it
            self.exception = e
        finally:
            self.ready.set()


def run_with_dashboard(
    recipe, run_dir=None, app_factory=WatchApp, resume: str | None = None
) -> dict | None:
    """Train ``recipe`` with the dashboard in front; returns the run's summary. An error while
    setting up is raised before the dashboard opens; one in training, after it closes."""
    # a new run's folder is chosen here, so the dashboard knows it; --resume names its run
    path = run_dir_for(recipe, run_dir) if resume is None else run_dir or recipe.run_dir
    worker = TrainingThread(recipe, path, resume)
    # bad input (recipe, data, model) is reported before the dashboard opens; the Trainer
    # leaves no folder behind
    worker.start()
    worker.ready.wait()
    if worker.exception is not None and not worker.built:
        worker.join()
        raise worker.exception
    path = Path(path)
    if worker.exception is not None and not worker.is_alive():
        raise worker.exception
    app_factory(path, training=worker).run()
    if worker.is_alive():
        print(
            f"dashboard closed; training goes on ({path}). `mlxtune watch {path}` opens it "
            "again; Ctrl-C stops the run gracefully.",
            file=sys.stderr,
        )
        try:
            while worker.is_alive():
                worker.join(0.5)
        except KeyboardInterrupt:
            request(path, "stop")
            print("stopping after this step...", file=sys.stderr)
            worker.join()
    if worker.exception is not None:
        raise worker.exception
    return worker.summary
