"""mlxtune watch: a Textual dashboard over a run directory.

It reads only the run directory (tui/rundata.py) and steers the trainer only through
RUN_DIR/control/ (mlxtune.loop.control), so it works the same on a running or a finished run, in
another terminal or in the same process, and closing it (ctrl+q) leaves training running.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Log, Static

from mlxtune.loop.control import request

from .plot import Plot
from .polling import PollingApp
from .rundata import RunData, ema

HELP = (
    "p pause/resume · s save a checkpoint · e evaluate · g generate a sample · q stop the run "
    "(finish the step, save, export; closes the dashboard once the run has ended) · "
    "[ ] less/more smoothing · l log/linear loss axis · 1-7 show/hide panels (7: the objective's plots) · ctrl+q close the "
    "dashboard only "
    "(training goes on)"
)

SMOOTHING_STEPS = [0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99]


def _log2(v):
    return math.log2(v) if v is not None and math.isfinite(v) and v > 0 else math.nan


def _fmt_time(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "--:--"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def _num(v, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN"
    return format(v, fmt)


def _metric(row: dict, key: str, fmt: str) -> str:
    """A metric of a logged row: '-' when absent, 'NaN' when written as null (the run directory
    writes non-finite numbers as null)."""
    if key in row and row[key] is None:
        return "NaN"
    return _num(row.get(key), fmt)


def versus(d: RunData) -> str:
    """The trained model beside the one it started from, from the run's own records: the eval
    loss before the first step (eval.at_start) and at the end, the exact match before and after
    (eval.exact_match); "" when the run recorded neither (mlxtune eval RUN_DIR --base says)."""
    s, parts = d.summary or {}, []
    xs, ys = d.eval_loss.xs, d.eval_loss.ys
    if len(xs) and xs[0] == 0 and s.get("final_eval_loss") is not None:
        parts.append(f"eval loss {_num(ys[0], '.4f')} → {_num(s['final_eval_loss'], '.4f')}")
    if s.get("exact_match_before") is not None and s.get("exact_match_after") is not None:
        before, after = 100 * s["exact_match_before"], 100 * s["exact_match_after"]
        parts.append(f"exact match {before:.1f}% → {after:.1f}%")
    return "\nbase → trained: " + ", ".join(parts) if parts else ""


class WatchApp(PollingApp):
    """A live view of one run; keys send requests to its trainer unless read-only."""

    CSS = """
    Screen { layout: vertical; }
    #header { height: auto; padding: 0 1; background: $panel; }
    #progress { height: 1; padding: 0 1; }
    #curves { height: 1fr; min-height: 8; }
    #loss { width: 2fr; }
    #side { width: 1fr; }
    #prefs { width: 1fr; display: none; }
    #info { height: auto; padding: 0 1; border-top: solid $primary; }
    #info > Static { height: auto; }
    #log { height: 5; min-height: 3; }
    """

    BINDINGS = [
        Binding("p", "control('pause')", "pause/resume"),
        Binding("s", "control('save')", "save"),
        Binding("e", "control('eval')", "eval"),
        Binding("g", "control('sample')", "sample"),
        Binding("q", "control('stop')", "stop run"),
        Binding("left_square_bracket", "smooth(-1)", "less smooth", show=False),
        Binding("right_square_bracket", "smooth(1)", "more smooth", show=False),
        Binding("l", "log_scale", "log loss", show=False),
        Binding("question_mark", "help", "help"),
        *[Binding(str(i), f"toggle({i})", show=False) for i in range(1, 8)],
    ]

    def __init__(
        self,
        run_dir: str | Path,
        read_only: bool = False,
        poll_s: float = 0.5,
        smoothing: float = 0.6,
        training=None,
    ):
        """``training``: when the dashboard runs in front of its own training (``mlxtune run
        --tui``), the thread that trains; its end and any error it raised are shown."""
        super().__init__()
        self.data = RunData(run_dir)
        self.read_only = read_only
        self.poll_s = poll_s
        self.smoothing = smoothing
        self.training = training
        self.paused = False
        self.requests: list[str] = []
        self._reported_end = False
        self._side_forced = False
        self._small = False
        self._prefs_shown = False

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="progress")
        with Horizontal(id="curves"):
            yield Plot("loss", id="loss")
            with Vertical(id="prefs"):  # preference and RL objectives: once rows carry them
                yield Plot("reward margin", id="margins")
                yield Plot("preference accuracy", id="accuracy")
            with Vertical(id="side"):
                yield Plot("learning rate", id="lr")
                yield Plot("grad norm", id="gnorm")
        with Vertical(id="info"):
            yield Static(id="stats")
            # Samples are model output and user data: shown as written, never read as markup
            # (a "[/INST]" in a prompt would otherwise be a closing tag).
            yield Static(id="sample", markup=False)
            yield Static(id="checkpoints")
        yield Log(id="log")
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"mlxtune · {self.data.run_dir.name}" + (
            " (read-only)" if self.read_only else ""
        )
        self.start_polling()

    # ------------------------------------------------------------------ data
    def _refresh(self) -> None:
        d = self.data
        self._check_training()
        changed = d.poll()
        if d.log_lines:
            log = self.query_one("#log", Log)
            for line in d.log_lines:
                log.write_line(line)
        if not changed and d.last:
            self._progress()  # keep the clock moving
            return
        self._draw()

    def _check_training(self) -> None:
        t = self.training
        if t is None or t.is_alive() or self._reported_end:
            return
        self._reported_end = True
        log = self.query_one("#log", Log)
        if t.error is not None:
            log.write_line(f"training stopped with an error: {t.error}")
            self.notify(f"training failed: {t.error}", severity="error", timeout=30)
        else:
            log.write_line("training finished; q closes the dashboard")

    def _draw(self) -> None:
        d = self.data
        cfg = d.config.get("recipe", {})
        der = d.config.get("derived", {})
        a = cfg.get("adapter", {})
        adapter = (
            a.get("type", "?")
            if a.get("type") == "full"
            else f"{a.get('type', '?')} r={a.get('rank')} alpha={a.get('alpha')}"
        )
        self.query_one("#header", Static).update(
            f"[b]{cfg.get('name', d.run_dir.name)}[/b] · model {d.config.get('model_dir') or 'new ' + str(d.config.get('model_config', {}).get('model_type', '?'))}"
            f" · {adapter} · {der.get('trainable_parameters', 0):,} trainable ({der.get('trainable_percent', 0):.2f}%)\n"
            f"data {der.get('train_examples', '?')} train / {der.get('valid_examples', '?')} valid · "
            f"{cfg.get('optimizer', {}).get('name', '?')} lr {cfg.get('optimizer', {}).get('lr', '?')} "
            f"{cfg.get('schedule', {}).get('name', '')} · batch {cfg.get('train', {}).get('batch_size', '?')} "
            f"× {cfg.get('train', {}).get('grad_accumulation', 1)} · {d.total_steps or '?'} steps"
        )
        self._progress()
        smooth = ema(d.loss.ys, self.smoothing)
        last = d.last
        title = f"loss {_metric(last, 'loss', '.4f')} · smoothed {_num(smooth[-1] if smooth else None, '.4f')} (ema {self.smoothing})"
        if self.query_one("#loss", Plot).log_y:
            title += " · log scale"
        if d.last_eval:
            title += f" · eval {_metric(d.last_eval, 'eval_loss', '.4f')}"
            if "eval_ppl" in d.last_eval:
                title += f" ppl {_metric(d.last_eval, 'eval_ppl', '.3f')}"
        self.query_one("#loss", Plot).show(
            [
                ("train", d.loss.xs, d.loss.ys, "dim"),
                ("smoothed", d.loss.xs, smooth, "line"),
                ("eval", d.eval_loss.xs, d.eval_loss.ys, "points"),
            ],
            title,
        )
        if d.objective_plots():
            self._draw_objective(last)
        self.query_one("#lr", Plot).show(
            [("lr", d.lr.xs, d.lr.ys, "line")], f"learning rate {_metric(last, 'lr', '.2e')}"
        )
        gn = [("grad norm", d.grad_norm.xs, d.grad_norm.ys, "line")]
        gtitle = f"grad norm {_metric(last, 'grad_norm', '.3f')}"
        if len(d.loss_scale):
            gn.append(
                ("loss scale (log2)", d.loss_scale.xs, [_log2(v) for v in d.loss_scale.ys], "line")
            )
            gtitle += f" · loss scale {_metric(last, 'loss_scale', 'g')}"
        self.query_one("#gnorm", Plot).show(gn, gtitle)
        self.query_one("#stats", Static).update(
            f"tokens/s {_metric(last, 'tokens_per_sec', ',.0f')} · step {_metric(last, 'step_time_s', '.3f')} s · "
            f"peak memory {_metric(last, 'peak_memory_gb', '.2f')} GB"
            + (
                f" (active {_metric(last, 'active_memory_gb', '.2f')}, cache "
                f"{_metric(last, 'cache_memory_gb', '.2f')})"
                if last and "active_memory_gb" in last
                else ""
            )
            + f" · grad norm {_metric(last, 'grad_norm', '.3f')}"
            + (  # multi-turn rollouts: each conversation's turns, tool calls and tool errors
                f" · turns {_metric(last, 'turns', '.2f')} · tool calls "
                f"{_metric(last, 'tool_calls', '.2f')} (errors {_metric(last, 'tool_errors', '.2f')})"
                if last and "turns" in last
                else ""
            )
            + (f" · {d.bad_lines} malformed lines skipped" if d.bad_lines else "")
        )
        if d.samples:
            # "prompt" is the prompt as a person reads it (the user's message for chat data);
            # rows from before prompt_text existed hold the whole prompt there, shown as is.
            s = d.samples[-1]
            # an image prompt names its pictures (the prompt shows each as [image])
            shown = ", ".join(Path(str(p)).name for p in s.get("images") or ())
            self.query_one("#sample", Static).update(
                f"sample @ {s.get('step')}: {s.get('prompt', '')!r} → {s.get('completion', '')!r}"
                + (f" (images: {shown})" if shown else "")
            )
        else:
            self.query_one("#sample", Static).update("no sample yet")
        self.query_one("#checkpoints", Static).update(
            "checkpoints: " + (", ".join(d.checkpoints()) or "none yet")
        )
        if d.summary is not None:
            self.query_one("#progress", Static).update(
                f"finished: {d.summary.get('steps')} steps · final loss {_num(d.summary.get('final_loss'), '.4f')} · "
                f"best eval {_num(d.summary.get('best_eval_loss'), '.4f')}" + versus(d)
            )

    def _draw_objective(self, last: dict) -> None:
        """The objective's own plots beside the loss (a preference run's reward margins and
        accuracy, a reinforcement-learning run's reward and completion length; train smoothed,
        eval as points), shown from the first row that has them."""
        d, prefs = self.data, self.query_one("#prefs")
        if not self._prefs_shown:  # the first rows that have them (a small terminal: folded)
            prefs.display = not self._small
            self._prefs_shown = True
        for plot, (what, key, fmt, train_of, eval_of) in zip(
            ("#margins", "#accuracy"), d.objective_plots(), strict=True
        ):
            train, evals = getattr(d, train_of), getattr(d, eval_of)
            title = f"{what} {_metric(last, key, fmt)}"
            if f"eval_{key}" in d.last_eval:
                title += f" · eval {_metric(d.last_eval, f'eval_{key}', fmt)}"
            self.query_one(plot, Plot).show(
                [
                    ("train", train.xs, ema(train.ys, self.smoothing), "line"),
                    ("eval", evals.xs, evals.ys, "points"),
                ],
                title,
            )

    def _progress(self) -> None:
        d = self.data
        if d.summary is not None:
            return
        step, total = d.last.get("step", 0), d.total_steps or 0
        width = 30
        done = int(width * step / total) if total else 0
        state = " · paused" if self.paused else ""
        self.query_one("#progress", Static).update(
            f"[{'#' * done}{'.' * (width - done)}] {step}/{total or '?'}  ETA {_fmt_time(d.eta_s())}{state}"
        )

    # ------------------------------------------------------------------ actions
    def action_control(self, what: str) -> None:
        if what == "stop" and self._ended():
            self.exit()
            return
        if self.read_only:
            self.notify("read-only: this dashboard does not steer the run", severity="warning")
            return
        if what == "pause":
            what = "resume" if self.paused else "pause"
            self.paused = not self.paused
        request(self.data.run_dir, what)
        self.requests.append(what)
        self.query_one("#log", Log).write_line(
            f"{time.strftime('%H:%M:%S')} asked the trainer to {what}"
        )
        self._progress()

    def _ended(self) -> bool:
        """The run has finished (its summary is written, or its training thread is gone)."""
        if self.training is not None:
            return not self.training.is_alive()
        return self.data.summary is not None

    def on_resize(self, event) -> None:
        """A small terminal shows the loss plot alone (2 and 3 bring the others back)."""
        self._small = event.size.width < 100 or event.size.height < 30
        if not self._side_forced:
            self.query_one("#side").display = not self._small
        if self.data.objective_plots():
            self.query_one("#prefs").display = not self._small

    def action_smooth(self, direction: int) -> None:
        steps = SMOOTHING_STEPS
        i = min(range(len(steps)), key=lambda j: abs(steps[j] - self.smoothing))
        self.smoothing = steps[max(0, min(len(steps) - 1, i + direction))]
        self._draw()

    def action_log_scale(self) -> None:
        """The loss plot's y axis between linear and logarithmic (a fine-tune's loss falls
        through several decades)."""
        loss = self.query_one("#loss", Plot)
        loss.log_y = not loss.log_y
        self._draw()

    def action_toggle(self, n: int) -> None:
        ids = {
            1: "#loss",
            2: "#lr",
            3: "#gnorm",
            4: "#stats",
            5: "#sample, #checkpoints",
            6: "#log",
            7: "#prefs",  # the objective's plots (margins and accuracy; reward and length)
        }
        for w in self.query(ids[n]):
            w.display = not w.display
        if n in (2, 3):  # the side column goes when both of its plots do
            side = self.query_one("#side")
            if not side.display:  # hidden for a small terminal: show it with this plot alone
                other = self.query_one("#gnorm" if n == 2 else "#lr")
                other.display = False
                w.display = True
            side.display = self.query_one("#lr").display or self.query_one("#gnorm").display
            self._side_forced = True

    def action_help(self) -> None:
        self.notify(HELP, timeout=10)
