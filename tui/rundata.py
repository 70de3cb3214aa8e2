"""What the dashboard knows about a run, read from its directory and nothing else.

``RunData.poll()`` reads what was appended to metrics.jsonl and samples.jsonl since the last call
(whole lines only: a half-written last line waits for the next poll), skips and counts lines that
are not JSON, and keeps at most ``max_points`` points per curve by dropping every other old
point when full, so a run of any length takes bounded memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


def _complete_lines(path: Path, offset: int) -> tuple[list[bytes], int]:
    """The complete lines of ``path`` after byte ``offset`` (a half-written last line waits for
    the next call), and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    return chunk[:end].splitlines(), offset + end + 1


class Tail:
    """Complete new JSON lines of a growing file, from a remembered byte offset."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.bad_lines = 0

    def rows(self) -> list[dict]:
        lines, self.offset = _complete_lines(self.path, self.offset)
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.bad_lines += 1
                continue
            if isinstance(row, dict):
                out.append(row)
            else:
                self.bad_lines += 1
        return out


class TextTail:
    """Complete new lines of a growing text file (the run's log.txt)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def lines(self) -> list[str]:
        lines, self.offset = _complete_lines(self.path, self.offset)
        return [line.decode("utf-8", errors="replace") for line in lines]


@dataclass
class Curve:
    """(x, y) points, decimated to stay under max_points."""

    max_points: int = 2000
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)

    def add(self, x, y):
        y = math.nan if y is None else float(y)
        self.xs.append(x)
        self.ys.append(y)
        if len(self.xs) > self.max_points:
            keep = len(self.xs) // 2  # thin the older half, keep recent points exact
            self.xs = self.xs[:keep:2] + self.xs[keep:]
            self.ys = self.ys[:keep:2] + self.ys[keep:]

    def __len__(self):
        return len(self.xs)


def ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average with bias correction (NaN values are skipped, not spread)."""
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            avg = alpha * avg + (1 - alpha) * v
            weight = alpha * weight + (1 - alpha)
        out.append(avg / weight if weight else math.nan)
    return out


# The objectives' paired figures in metrics rows: (the key a row has them by, the other key,
# the curves each goes to, named as RunData attributes). Preference objectives (dpo, orpo, cpo,
# reward): the implicit rewards' margin and accuracy; reinforcement learning (grpo): the mean
# reward and completion length of the completions drawn.
_OBJECTIVE_ROWS = (
    ("rewards/margins", "rewards/accuracies", "margins", "accuracy"),
    ("reward", "completion_length", "reward", "completion_length"),
)


class RunData:
    def __init__(self, run_dir: str | Path, max_points: int = 2000):
        self.run_dir = Path(run_dir)
        self.metrics = Tail(self.run_dir / "metrics.jsonl")
        self.sample_tail = Tail(self.run_dir / "samples.jsonl")
        self.log_tail = TextTail(self.run_dir / "log.txt")
        self.log_lines: list[str] = []  # new since the last poll
        self.loss = Curve(max_points)
        self.eval_loss = Curve(max_points)
        self.lr = Curve(max_points)
        self.tokens_per_sec = Curve(max_points)
        self.grad_norm = Curve(max_points)
        self.loss_scale = Curve(max_points)
        # train loss against tokens seen, and eval loss likewise (compare aligns runs by it)
        self.loss_by_tokens = Curve(max_points)
        self.eval_by_tokens = Curve(max_points)
        # preference objectives (dpo, orpo, cpo, reward): the implicit rewards' margin and accuracy,
        # by step and by tokens seen
        self.margins, self.eval_margins = Curve(max_points), Curve(max_points)
        self.accuracy, self.eval_accuracy = Curve(max_points), Curve(max_points)
        self.margins_by_tokens, self.eval_margins_by_tokens = Curve(max_points), Curve(max_points)
        self.accuracy_by_tokens = Curve(max_points)
        self.eval_accuracy_by_tokens = Curve(max_points)
        # reinforcement learning (grpo): mean reward and completion length of the completions
        # drawn in training, and the held-out reward and length of each evaluation
        self.reward, self.eval_reward = Curve(max_points), Curve(max_points)
        self.completion_length = Curve(max_points)
        self.eval_completion_length = Curve(max_points)
        self.reward_by_tokens, self.eval_reward_by_tokens = Curve(max_points), Curve(max_points)
        self.completion_length_by_tokens = Curve(max_points)
        self.eval_completion_length_by_tokens = Curve(max_points)
        self.last: dict = {}
        self.last_eval: dict = {}
        self.first_time: float | None = None
        self.samples: list[dict] = []
        self.config: dict = {}
        self.summary: dict | None = None

    @property
    def bad_lines(self) -> int:
        return self.metrics.bad_lines + self.sample_tail.bad_lines

    @property
    def total_steps(self) -> int | None:
        return self.config.get("derived", {}).get("effective_steps")

    def poll(self) -> bool:
        """Read what is new; True if anything changed."""
        changed = False
        if not self.config:
            try:
                self.config = json.loads((self.run_dir / "config_resolved.json").read_text())
                changed = True
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        for row in self.metrics.rows():
            changed = True
            step = row.get("step")
            if "loss" in row:
                self.last = row
                if self.first_time is None and row.get("time"):
                    self.first_time = row["time"] - row.get("step_time_s", 0) * step
                self.loss.add(step, row.get("loss"))
                self.lr.add(step, row.get("lr"))
                self.tokens_per_sec.add(step, row.get("tokens_per_sec"))
                self.grad_norm.add(step, row.get("grad_norm"))
                if "loss_scale" in row:
                    self.loss_scale.add(step, row.get("loss_scale"))
                self.loss_by_tokens.add(row.get("tokens_seen", 0), row.get("loss"))
                self._add_objective(row, step, row.get("tokens_seen", 0), "")
            if "eval_loss" in row:
                self.last_eval = row
                self.eval_loss.add(step, row.get("eval_loss"))
                self.eval_by_tokens.add(self.last.get("tokens_seen", 0), row.get("eval_loss"))
                self._add_objective(row, step, self.last.get("tokens_seen", 0), "eval_")
        self.log_lines = self.log_tail.lines()[-500:]
        changed = changed or bool(self.log_lines)
        new_samples = self.sample_tail.rows()
        if new_samples:
            self.samples = (self.samples + new_samples)[-20:]
            changed = True
        if self.summary is None and (self.run_dir / "summary.json").exists():
            try:
                self.summary = json.loads((self.run_dir / "summary.json").read_text())
                changed = True
            except json.JSONDecodeError:
                pass
        return changed

    def _add_objective(self, row: dict, step, tokens, prefix: str) -> None:
        """The objective's paired figures of a metrics row (``prefix``: "" for training's,
        "eval_" for an evaluation's) onto their curves, by step and by tokens seen."""
        for key, other, first, second in _OBJECTIVE_ROWS:
            if prefix + key in row:
                for name, value in ((first, row[prefix + key]), (second, row.get(prefix + other))):
                    getattr(self, prefix + name).add(step, value)
                    getattr(self, f"{prefix}{name}_by_tokens").add(tokens, value)

    @property
    def preference(self) -> bool:
        """Whether the run trains on preference pairs (its rows carry reward margins)."""
        return bool(len(self.margins) or len(self.eval_margins))

    @property
    def rl(self) -> bool:
        """Whether the run is reinforcement learning (its rows carry rewards)."""
        return bool(len(self.reward) or len(self.eval_reward))

    def objective_plots(self) -> list[tuple[str, str, str, str, str]]:
        """The objective's own two plots beside the loss: (title, row key, number format,
        train curve, eval curve) each, the curves named as attributes of this object; none for
        a run that has no such rows (yet)."""
        if self.preference:
            return [
                ("reward margin", "rewards/margins", ".3f", "margins", "eval_margins"),
                ("preference accuracy", "rewards/accuracies", ".1%", "accuracy", "eval_accuracy"),
            ]
        if self.rl:
            return [
                ("reward", "reward", ".3f", "reward", "eval_reward"),
                (
                    "completion length",
                    "completion_length",
                    ".1f",
                    "completion_length",
                    "eval_completion_length",
                ),
            ]
        return []

    def eta_s(self) -> float | None:
        step, total = self.last.get("step"), self.total_steps
        if not step or not total or not self.last.get("step_time_s"):
            return None
        return max(total - step, 0) * self.last["step_time_s"]

    def checkpoints(self) -> list[str]:
        folder = self.run_dir / "checkpoints"
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
