"""mlxtune compare: several runs side by side, from their run directories: their loss curves
overlaid (aligned by step or by tokens seen) and a table of their figures."""

from __future__ import annotations

import math
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer

from .plot import Plot
from .polling import PollingApp
from .rundata import RunData, ema


def _f(v, fmt):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, fmt)


def compare_rows(run_dirs: list) -> list[dict]:
    """One row of figures per run (a run directory or its RunData): steps, tokens seen, final
    and best losses, speed, memory."""
    rows = []
    for rd in run_dirs:
        d = rd if isinstance(rd, RunData) else RunData(rd)
        rd = d.run_dir
        d.poll()
        s = d.summary or {}
        evals = [v for v in d.eval_loss.ys if math.isfinite(v)]
        speeds = [v for v in d.tokens_per_sec.ys if math.isfinite(v)]
        name = d.config.get("recipe", {}).get("name", Path(rd).name)
        folder = Path(rd).name
        rows.append(
            {
                "run": str(rd),
                "name": name,
                # runs of one recipe share a name: the folder tells them apart
                "label": folder if name in folder else f"{folder} ({name})",
                "steps": d.last.get("step"),
                "tokens_seen": d.last.get("tokens_seen"),
                "final_loss": d.last.get("loss"),
                "best_eval_loss": min(evals) if evals else None,
                "tokens_per_sec": sum(speeds) / len(speeds) if speeds else None,
                "peak_memory_gb": d.last.get("peak_memory_gb"),
                "finished": bool(s),
            }
        )
    return rows


COLUMNS = ("run", "steps", "tokens", "final loss", "best eval", "tok/s", "peak GB", "done")


def table_cells(rows: list[dict]) -> list[tuple[str, ...]]:
    """Each run's row of COLUMNS as text, named by its label (the run's folder, with the recipe's
    name beside it unless the folder holds it); the best eval loss is marked with " *"."""
    best = min((r["best_eval_loss"] for r in rows if r["best_eval_loss"] is not None), default=None)
    return [
        (
            r["label"],
            _f(r["steps"], "d"),
            _f(r["tokens_seen"], ",d"),
            _f(r["final_loss"], ".4f"),
            _f(r["best_eval_loss"], ".4f")
            + (" *" if best is not None and r["best_eval_loss"] == best else ""),
            _f(r["tokens_per_sec"], ",.0f"),
            _f(r["peak_memory_gb"], ".2f"),
            "yes" if r["finished"] else "running",
        )
        for r in rows
    ]


def format_table(rows: list[dict]) -> str:
    """The table as plain text (``mlxtune compare --table``)."""
    widths = (28, 7, 11, 12, 12, 9, 8, 7)

    def line(cells):
        first, *rest, last = cells
        middle = " ".join(f"{c:>{w}}" for c, w in zip(rest, widths[1:-1], strict=True))
        return f"{first[: widths[0]]:<{widths[0]}} {middle}  {last}"

    head = line(COLUMNS)
    return "\n".join([head, "-" * len(head), *(line(c) for c in table_cells(rows))])


class CompareApp(PollingApp):
    """The runs' loss curves overlaid (train smoothed, eval as points) and their table; t switches
    the x axis between steps and tokens seen. Running runs update live."""

    CSS = """
    #overlay { height: 1fr; min-height: 8; }
    #prefs { height: 1fr; min-height: 8; display: none; }
    #table { height: auto; max-height: 12; }
    """
    TITLE = "mlxtune compare"
    BINDINGS = [
        Binding("t", "toggle_x", "step/tokens"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, run_dirs, by: str = "step", poll_s: float = 1.0, smoothing: float = 0.6):
        super().__init__()
        self.runs = [RunData(rd) for rd in run_dirs]
        self.by = by
        self.poll_s = poll_s
        self.smoothing = smoothing

    def compose(self) -> ComposeResult:
        yield Plot("loss", id="overlay")
        with Horizontal(id="prefs"):  # preference runs' margins and accuracy; RL: reward, length
            yield Plot("reward margin", id="margins")
            yield Plot("preference accuracy", id="accuracy")
        yield DataTable(id="table", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#table", DataTable).add_columns(*COLUMNS)
        self.start_polling()

    def _refresh(self) -> None:
        rows = compare_rows(self.runs)  # polls each run
        series = []
        for i, (d, row) in enumerate(zip(self.runs, rows, strict=True)):
            label = row["label"]
            train = d.loss_by_tokens if self.by == "tokens" else d.loss
            evals = d.eval_by_tokens if self.by == "tokens" else d.eval_loss
            series.append((label, train.xs, ema(train.ys, self.smoothing), "line", i))
            if len(evals):
                series.append((f"{label} eval", evals.xs, evals.ys, "points", i))
        self.query_one("#overlay", Plot).show(
            series,
            f"loss (train smoothed, ema {self.smoothing}; eval as points) by {self.by}",
            "tokens seen" if self.by == "tokens" else "step",
        )
        if any(d.objective_plots() for d in self.runs):
            self._overlay_objective(rows)
        table = self.query_one("#table", DataTable)
        table.clear()
        for cells in table_cells(rows):
            table.add_row(*cells)

    def _overlay_objective(self, rows: list[dict]) -> None:
        """The objectives' own plots overlaid like the loss: preference runs' reward margins and
        accuracies, or reinforcement-learning runs' rewards and completion lengths (the kind the
        first such run is)."""
        self.query_one("#prefs").display = True
        tokens = self.by == "tokens"
        kinds = next(d.objective_plots() for d in self.runs if d.objective_plots())
        for plot, (what, _, _, train_of, eval_of) in zip(
            ("#margins", "#accuracy"), kinds, strict=True
        ):
            series = []
            for i, (d, row) in enumerate(zip(self.runs, rows, strict=True)):
                if d.objective_plots() != kinds:
                    continue
                suffix = "_by_tokens" if tokens else ""
                train, evals = getattr(d, train_of + suffix), getattr(d, eval_of + suffix)
                series.append((row["label"], train.xs, ema(train.ys, self.smoothing), "line", i))
                if len(evals):
                    series.append((f"{row['label']} eval", evals.xs, evals.ys, "points", i))
            self.query_one(plot, Plot).show(
                series,
                f"{what} (train smoothed; eval as points)",
                "tokens seen" if tokens else "step",
            )

    def action_toggle_x(self) -> None:
        self.by = "tokens" if self.by == "step" else "step"
        self.refresh_data()
