"""Where a run's records go: metrics rows and samples into the run directory, and on to the
recipe's reporters (TensorBoard, Weights & Biases) on rank 0."""

from __future__ import annotations

import time

from ..config import dump_yaml
from .report import open_reporters


class Records:
    """The run's metrics.jsonl and samples.jsonl, with the reporters that also get them."""

    def __init__(self, run_dir, console):
        self.run_dir, self.console = run_dir, console
        self.reporters: list = []

    def open(self, recipe, resumed_at: int | None) -> None:
        """Start the recipe's reporters (``report``); a resumed run's go on from ``resumed_at``."""
        if recipe.report:
            text = dump_yaml(recipe.to_dict())
            self.reporters = open_reporters(recipe, self.run_dir.path, text, resumed_at)

    def close(self, failed: bool) -> None:
        for rep in self.reporters:
            rep.close(failed)
        self.reporters = []

    def row(self, row: dict) -> None:
        """A metrics row: into metrics.jsonl, and to the reporters."""
        self.run_dir.append_jsonl("metrics.jsonl", row)
        for rep in self.reporters:
            rep.row(row)

    def samples(self, step: int, drawn: list[dict], evaluated: bool = False) -> None:
        """Samples: into samples.jsonl (``eval`` marks an evaluation's), to the reporters, and
        the first on the console."""
        for s in drawn:
            mark = {"eval": True} if evaluated else {}
            self.run_dir.append_jsonl(
                "samples.jsonl", {"step": step, **mark, **s, "time": time.time()}
            )
        for rep in self.reporters if drawn else ():
            rep.samples(step, drawn)
        if drawn:
            self.console.sample(step, drawn[0]["prompt"], drawn[0]["completion"])


__all__ = ["Records"]
