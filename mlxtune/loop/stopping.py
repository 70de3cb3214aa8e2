"""Early stopping and the best checkpoint's rule: one evaluation metric watched
(``train.early_stopping``), its best so far and the evaluations since it last improved kept in
the loop's position (so a resumed run counts on from where it was)."""

from __future__ import annotations

import math

from ..engine.state import LoopPosition
from ..errors import UserInputError

HIGHER_IS_BETTER = ("reward", "accuracy", "exact_match")
"""Words in a metric's name that make higher better for early stopping and the best checkpoint."""


def watch_mode(e) -> str:
    """ "min" or "max": train.early_stopping.mode, or what the metric's name implies."""
    if e.mode is not None:
        return e.mode
    return "max" if any(w in e.metric for w in HIGHER_IS_BETTER) else "min"


def watch(e, pos: LoopPosition, m: dict) -> tuple[bool, str | None]:
    """One evaluation ``m`` against train.early_stopping ``e``: (whether the watched metric beat
    its best so far, the best checkpoint's rule; why the run should stop early, or None).
    ``pos`` keeps the best and the evaluations in a row without an improvement of more than
    min_delta; a metric the evaluation does not report is bad input naming the key."""
    if e.metric not in m or not isinstance(m[e.metric], (int, float)):
        names = ", ".join(k for k, x in m.items() if isinstance(x, (int, float)))
        raise UserInputError(
            f"{e.metric!r} is not one of this run's evaluation metrics: {names}",
            "train.early_stopping.metric",
        )
    sign = 1.0 if watch_mode(e) == "min" else -1.0
    best = pos.best_watched
    if best is None and e.metric == "eval_loss" and math.isfinite(pos.best_eval):
        best = pos.best_eval  # a checkpoint from before the metric was kept on its own
    gain = math.inf if best is None else sign * best - sign * m[e.metric]
    pos.stalled = 0 if gain > e.min_delta else pos.stalled + 1
    stop = None
    if e.patience is not None and pos.stalled >= e.patience:
        stop = (
            f"early stopping: {e.metric} has not improved by more than {e.min_delta:g} in "
            f"{pos.stalled} evaluations (best {best:.6g})"
        )
    if gain > 0:
        pos.best_watched = m[e.metric]
    return gain > 0, stop
