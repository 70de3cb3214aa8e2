"""mlxtune compare: the figures of several runs side by side (from their run directories)."""

from __future__ import annotations

import math
from pathlib import Path

from .rundata import RunData


def _f(v, fmt):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, fmt)


def compare_rows(run_dirs: list[str | Path]) -> list[dict]:
    """One row of figures per run: steps, tokens seen, final and best losses, speed, memory."""
    rows = []
    for rd in run_dirs:
        d = RunData(rd)
        d.poll()
        s = d.summary or {}
        evals = [v for v in d.eval_loss.ys if math.isfinite(v)]
        speeds = [v for v in d.tokens_per_sec.ys if math.isfinite(v)]
        rows.append(
            {
                "run": str(rd),
                "name": d.config.get("recipe", {}).get("name", Path(rd).name),
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


def format_table(rows: list[dict]) -> str:
    head = f"{'run':<28} {'steps':>7} {'tokens':>11} {'final loss':>10} {'best eval':>10} {'tok/s':>9} {'peak GB':>8}  done"
    lines = [head, "-" * len(head)]
    best = min((r["best_eval_loss"] for r in rows if r["best_eval_loss"] is not None), default=None)
    for r in rows:
        mark = " *" if best is not None and r["best_eval_loss"] == best else ""
        lines.append(
            f"{r['name'][:28]:<28} {_f(r['steps'], 'd'):>7} {_f(r['tokens_seen'], ',d'):>11} {_f(r['final_loss'], '.4f'):>10} "
            f"{_f(r['best_eval_loss'], '.4f'):>10} {_f(r['tokens_per_sec'], ',.0f'):>9} {_f(r['peak_memory_gb'], '.2f'):>8}  "
            f"{'yes' if r['finished'] else 'running'}{mark}"
        )
    return "\n".join(lines)
