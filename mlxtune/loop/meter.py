"""Accounting for queued steps: the loop queues each optimizer step without waiting for it, and
the meter reads them (one wait for all) where the loop needs their results, adding each to the
window of sums behind the next metrics row and timing them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..engine.state import LoopPosition, Window
from ..errors import TrainingError
from ..objectives.base import metric_means
from .callbacks import StepRecord


@dataclass(eq=False)
class StepMeter:
    """The queued steps and the wall clock (not resumed: a resumed run times afresh)."""

    mark: float = 0.0
    """When the time being counted began."""
    queued: list[StepRecord] = field(default_factory=list)
    first_step: float | None = None
    """The first step's seconds, compilation included (it is read alone), and the tokens it
    trained on."""
    first_targets: int = 0
    total: float = 0.0
    steps: int = 0

    def mean_step_time(self) -> float | None:
        return self.total / self.steps if self.steps else self.first_step

    def read(self, pos: LoopPosition, engine, log, last_saved) -> None:
        """Wait for the queued steps and account for each in order: its loss, metrics and
        gradient norm, whether its update was applied, the tokens trained on, the engine's
        verdict on a non-finite step (``engine.nonfinite`` with ``log`` and ``last_saved``),
        and the time they took. A verdict that ends the run is raised once all are read."""
        queued = self.queued
        if not queued:
            return
        mx.eval(
            [
                (q.result.loss_sum, q.result.norm, q.result.ok, q.result.metrics, q.scale, q.lr)
                for q in queued
            ]
        )
        now = time.perf_counter()
        elapsed, self.mark = now - self.mark, now
        self.queued = []
        for q in queued:
            res = q.result
            q.grad_norm, q.lr_value, q.applied = res.norm.item(), q.lr.item(), res.ok.item()
        w = pos.window
        if self.first_step is None:
            self.first_step = elapsed
            self.first_targets = sum(q.targets for q in queued if q.applied)
        else:
            w.timed_n += sum(q.targets for q in queued if q.applied)
            w.time += elapsed
            w.steps += len(queued)
            self.total += elapsed
            self.steps += len(queued)
        after = [q.scale for q in queued[1:]] + [engine.scaler["scale"]]
        stop = None
        for q, scale_after in zip(queued, after, strict=True):
            loss_sum = q.result.loss_sum.item()
            sums = {k: v.item() for k, v in q.result.metrics.items()}
            q.loss = loss_sum / max(q.n, 1)
            q.metrics = metric_means(sums, max(q.n, 1))
            if q.applied:
                engine.in_a_row = 0
                pos.tokens_seen += q.targets  # trained on: a skipped step's do not count
                w.loss += loss_sum
                w.n += q.n
                for k, v in sums.items():
                    w.metrics[k] = w.metrics.get(k, 0.0) + v
                pos.last_loss = q.loss
            merge_host(w.host, q.host)
            q.tokens_seen = pos.tokens_seen
            q.read = True
            if not q.applied and stop is None:
                try:
                    engine.nonfinite(
                        q.step, q.loss, q.scale.item(), scale_after.item(), log, last_saved
                    )
                except TrainingError as e:
                    stop = e
        if stop is not None:
            raise stop

    def row(self, pos: LoopPosition, engine, epoch: float, record: StepRecord, packed: bool):
        """The metrics row for the steps read since the last one; the window starts again."""
        w = pos.window
        if not w.steps:  # only the first (compiling) step so far: it is all we have
            w.timed_n, w.time, w.steps = self.first_targets, self.first_step, 1
        row = {
            "step": pos.step,
            "epoch": round(epoch, 4),
            # null when every step since the last row was skipped
            "loss": w.loss / w.n if w.n else None,
            "grad_norm": record.grad_norm if math.isfinite(record.grad_norm) else None,
            "lr": record.lr_value,
            "tokens_seen": pos.tokens_seen,
            "tokens_per_sec": w.timed_n / w.time,
            "step_time_s": w.time / w.steps,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            # what the arrays hold now, and the cache of freed buffers MLX keeps for reuse:
            # growth across rows that the peak does not show
            "active_memory_gb": mx.get_active_memory() / 1e9,
            "cache_memory_gb": mx.get_cache_memory() / 1e9,
            "time": time.time(),
        }
        row.update(metric_means(w.metrics, w.n))
        for k, (v, weight) in sorted(w.host.items()):
            row[k] = v if k.endswith("_max") else v / weight if weight else None
        if packed:
            row["packing_utilization"] = round(w.real / max(w.room, 1), 4)
        if engine.scaling != "none":
            row["loss_scale"] = engine.scaler["scale"].item()
        if engine.skipped:
            row["skipped_steps"] = engine.skipped
        if pos.first_row:
            row["first_step_compile_time_s"] = self.first_step
            pos.first_row = False
        pos.window = Window()
        return row


def merge_host(into: dict, more: dict) -> None:
    """Add host metrics ``more`` (name -> (sum, weight)) to ``into``: sums and weights add up,
    a name ending in ``_max`` keeps the larger value."""
    for k, (v, weight) in more.items():
        if k not in into:
            into[k] = [float(v), float(weight)]
        elif k.endswith("_max"):
            into[k] = [max(into[k][0], float(v)), 1.0]
        else:
            into[k] = [into[k][0] + float(v), into[k][1] + float(weight)]
