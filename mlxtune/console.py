"""What a run prints: a header, one line per log step, a progress bar with ETA on a terminal,
and a summary."""

from __future__ import annotations

import math
import sys
import time


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "--:--"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


class Console:
    """Prints to stderr; the progress bar is drawn only when stderr is a terminal."""

    def __init__(self, quiet: bool = False, progress: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.progress = progress and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar_shown = False
        self._total = 0
        self._t0 = 0.0
        self._rows_t0 = 0.0

    def _print(self, text: str):
        if self.quiet:
            return
        if self._bar_shown:
            self.stream.write("\r\033[K")
            self._bar_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def info(self, text: str):
        self._print(text)

    def header(self, lines: list[str]):
        self._print("\n".join(lines))

    def start_progress(self, total: int):
        self._total = total
        self._t0 = time.perf_counter()

    def advance(self, step: int, loss: float):
        if not self.progress or self.quiet:
            return
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / step * (self._total - step) if step else math.inf
        width = 30
        done = int(width * step / max(self._total, 1))
        bar = "#" * done + "." * (width - done)
        self.stream.write(
            f"\r\033[K[{bar}] {step}/{self._total} {100 * step / max(self._total, 1):3.0f}%  "
            f"loss {loss:.4f}  elapsed {_fmt_time(elapsed)}  ETA {_fmt_time(eta)}"
        )
        self.stream.flush()
        self._bar_shown = True

    def rows(self, label: str, done: int, total: int):
        """A progress bar of work over rows (encoding a split), on a terminal only; cleared once
        ``done`` reaches ``total``."""
        if not self.progress or self.quiet:
            return
        if done >= total:
            if self._bar_shown:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self._bar_shown = False
            return
        if done == 0:
            self._rows_t0 = time.perf_counter()
        elapsed = time.perf_counter() - self._rows_t0
        eta = elapsed / done * (total - done) if done else math.inf
        width = 30
        bar = "#" * int(width * done / total) + "." * (width - int(width * done / total))
        self.stream.write(
            f"\r\033[K[{bar}] {label}: {done:,}/{total:,} rows  elapsed {_fmt_time(elapsed)}  "
            f"ETA {_fmt_time(eta)}"
        )
        self.stream.flush()
        self._bar_shown = True

    def end_progress(self):
        if self._bar_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._bar_shown = False

    def log_step(self, row: dict, total: int):
        loss = "skipped" if row["loss"] is None else f"{row['loss']:.4f}"
        grad = "n/a" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
        extra = f" | scale {row['loss_scale']:g}" if "loss_scale" in row else ""
        if row.get("skipped_steps"):
            extra += f" | {row['skipped_steps']} skipped"
        extra += _preference(row) + _rl(row)
        self._print(
            f"step {row['step']:>6}/{total} | loss {loss} | lr {row['lr']:.2e} | "
            f"grad {grad} | {row['tokens_per_sec']:,.0f} tok/s | "
            f"peak {row['peak_memory_gb']:.2f} GB{extra}"
        )

    def log_eval(self, row: dict):
        extra = f" | ppl {row['eval_ppl']:.3f}" if "eval_ppl" in row else ""
        extra += _preference(row, "eval_")
        if "eval_reward" in row:  # its loss is the negative reward
            self._print(
                f"eval @ {row['step']:>5} | reward {row['eval_reward']:.4f} over "
                f"{row['eval_prompts']} held-out prompts | completion length "
                f"{row['eval_completion_length']:.1f}"
            )
            return
        self._print(f"eval @ {row['step']:>5} | loss {row['eval_loss']:.4f}{extra}")

    def sample(self, step: int, prompt: str, completion: str):
        self._print(f"sample @ {step}: {prompt!r} -> {completion!r}")

    def dry_run(self, out: dict):
        self._print(
            f"dry run: one step compiled and ran in {out['first_step_compile_time_s']:.2f} s, "
            f"loss {out['loss']:.4f}, grad norm {out['grad_norm']:.3f}, peak {out['peak_memory_gb']:.2f} GB"
        )

    def summary(self, s: dict):
        lines = [
            "done",
            f"  steps {s['steps']} in {_fmt_time(s['train_time_s'])} "
            f"(mean step {s['mean_step_time_s']:.3f} s, first step {s['first_step_compile_time_s']:.2f} s with compile)",
            f"  loss: final train {s['final_loss']:.4f}, final eval {s['final_eval_loss']:.4f}, best eval {s['best_eval_loss']:.4f}",
            f"  tokens seen {s['tokens_seen']:,}, peak memory {s['peak_memory_gb']:.2f} GB",
        ]
        if "exact_match_before" in s:
            lines.append(
                f"  exact match on held-out prompts: {100 * s['exact_match_before']:.1f}% untrained -> "
                f"{100 * s['exact_match_after']:.1f}% trained"
            )
        if "final_eval_reward" in s:
            start = s.get("eval_reward_at_start")
            was = f"{start:.3f} at the start -> " if start is not None else ""
            lines.append(f"  reward on held-out prompts: {was}{s['final_eval_reward']:.3f}")
        lines.append(f"  run directory: {s['run_dir']}")
        self._print("\n".join(lines))


def _preference(row: dict, prefix: str = "") -> str:
    """A preference objective's margin and accuracy, when the row has them."""
    acc, margin = row.get(f"{prefix}rewards/accuracies"), row.get(f"{prefix}rewards/margins")
    if acc is None or margin is None:
        return ""
    return f" | margin {margin:.3f} | acc {100 * acc:.1f}%"


def _rl(row: dict) -> str:
    """A reinforcement-learning objective's mean reward and completion length, when the row
    has them."""
    if row.get("reward") is None:
        return ""
    out = f" | reward {row['reward']:.3f}"
    if row.get("completion_length") is not None:
        out += f" | len {row['completion_length']:.1f}"
    return out
