"""The longest context mlxtune and mlx-lm each train at equal memory, in one process.

    python bench/context_length.py --model 1b --dtype bfloat16 --budget-gb 24   # for a GPU
    python bench/context_length.py --quick                                      # tiny, CPU

Both trainers get the same base model, LoRA (rank 8 on q_proj/v_proj) and one row of plain text
of T tokens a step (batch 1, trained on every token), as bench/compare_mlx_lm.py sets them up.
T doubles from --start; each setting's ladder stops at the first T whose peak memory (MLX's
peak over two steps, weights included) is over the budget or that fails. MLX's memory limit is
set to the budget: without it, a GPU with memory to spare lets MLX run far ahead and keep every
chunk of a chunked computation alive at once, and the peak says nothing about what the step
needs (an H200 showed this). Settings: each trainer
at its defaults, and each with its gradient checkpointing (mlxtune's train.grad_checkpointing,
mlx_lm.lora's --grad-checkpoint). The answer is the longest T within the budget, per setting, and
the ratios mlxtune / mlx-lm (defaults against defaults, checkpointed against checkpointed).
mlx-lm's checkpointing patches its layer class for the rest of the process, so its ladder runs
last. --budget-s stops a setting starting new rungs after that many seconds (its longest T is
then a lower bound, and the rung it did not start is listed). Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lora_runs as cm  # noqa: E402  (sets up OpenBLAS through mlxtune first)

# isort: split
import mlx.core as mx  # noqa: E402

SETTINGS = [  # (name, trainer, gradient checkpointing)
    ("mlxtune", "mlxtune", False),
    ("mlxtune+ckpt", "mlxtune", True),
    ("mlx-lm", "mlx-lm", False),
    ("mlx-lm+ckpt", "mlx-lm", True),  # last: mlx-lm's checkpointing patches its layer class
]


def rung(name, kind, base, tmp: Path, t: int, ckpt: bool, attention: str) -> dict:
    """One setting at T tokens: peak GB over two steps and tokens/s of the second."""
    cm.TEXT_LENGTH = t
    cm.CHAT_MAX = t
    data = tmp / f"text-{t}.jsonl"
    cfg = {"examples": 1, "steps": 2, "report": 1}
    if not data.exists():
        cm.write_data("text-fixed", data, cm.rows_for(2))
    ours = cm.run_mlxtune(
        base, data, "text-fixed", cfg, tmp / f"run-{name}-{t}", 8, 1e-4,
        attention=attention, train_extra={"grad_checkpointing": ckpt}, split=False,
        examples_only=kind != "mlxtune",
    )  # fmt: skip
    if kind == "mlxtune":
        return {"peak_gb": ours["peak_gb"], "tokens_per_sec": ours["tokens_per_sec"]}
    theirs = cm.run_mlx_lm(
        base, ours["examples"], cfg, 2, 8, 1e-4, grad_checkpoint=ckpt, max_seq_length=t + 1
    )
    return {"peak_gb": theirs["peak_gb"], "tokens_per_sec": theirs["tokens_per_sec"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "1b"], default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--budget-gb", type=float, default=2.0, help="peak memory allowed, GB")
    ap.add_argument("--start", type=int, default=512, help="first T")
    ap.add_argument("--stop", type=int, default=131072, help="largest T tried")
    ap.add_argument(
        "--budget-s", type=float, help="seconds per setting after which it starts no new rung"
    )
    ap.add_argument(
        "--settings",
        nargs="+",
        choices=[name for name, _, _ in SETTINGS],
        help="settings to run (default: all four; mlx-lm+ckpt always runs last)",
    )
    ap.add_argument("--attention", default="auto", help="mlxtune's kernels.attention")
    ap.add_argument(
        "--no-limit",
        action="store_true",
        help="leave MLX's memory limit alone (default: set it to the budget, so that MLX holds "
        "back work that would go over it, as on a machine of that size)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="--budget-gb 0.3 --stop 1024 --vocab 8192 (a CPU check)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.budget_gb, args.stop, args.vocab = 0.3, 1024, 8192
    cm.DTYPE = args.dtype
    cm.MODEL.clear()
    cm.MODEL.update(cm.MODELS[args.model])
    if not args.no_limit:
        mx.set_memory_limit(int(args.budget_gb * 1e9))
    t0 = time.perf_counter()
    ladders: dict[str, list] = {}
    longest: dict[str, int | None] = {}
    cut = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = cm.build_base(tmp / "base", args.vocab)
        for name, kind, ckpt in SETTINGS:
            if args.settings and name not in args.settings:
                continue
            ladders[name], longest[name] = [], None
            t, t_setting = args.start, time.perf_counter()
            while t <= args.stop:
                if args.budget_s is not None and time.perf_counter() - t_setting > args.budget_s:
                    cut.append(f"{name} T={t}")
                    break
                try:
                    r = rung(name, kind, base, tmp, t, ckpt, args.attention)
                except Exception as e:  # out of memory, most likely
                    r = {"error": str(e).splitlines()[0][:200]}
                r = {"tokens": t, **r}
                ladders[name].append(r)
                print(f"  {name:13} T={t:6}: " + (
                    f"peak {r['peak_gb']:.2f} GB, {r['tokens_per_sec']:,.0f} tok/s"
                    if "error" not in r else f"failed: {r['error']}"
                ), file=sys.stderr, flush=True)  # fmt: skip
                if "error" in r or r["peak_gb"] > args.budget_gb:
                    break
                longest[name] = t
                t *= 2
    ratios = {}
    for ours, theirs in (("mlxtune", "mlx-lm"), ("mlxtune+ckpt", "mlx-lm+ckpt")):
        if longest.get(ours) and longest.get(theirs):
            ratios[f"{ours} / {theirs}"] = round(longest[ours] / longest[theirs], 2)
    print(
        f"model {args.model} {args.dtype}, vocab {args.vocab}, {mx.default_device()}, budget "
        f"{args.budget_gb:g} GB; {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    for name in ladders:
        print(f"{name:13} longest T within budget: {longest[name]}", file=sys.stderr)
    for k, v in ratios.items():
        print(f"{k}: {v}x", file=sys.stderr)
    if cut:
        print(f"not started (--budget-s): {'; '.join(cut)}", file=sys.stderr)
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "vocab": args.vocab,
                "device": str(mx.default_device()),
                "budget_gb": args.budget_gb,
                "attention": args.attention,
                "memory_limit": not args.no_limit,
                "longest": longest,
                "ratios": ratios,
                "ladders": ladders,
                "not_started": cut,
            }
        )
    )


if __name__ == "__main__":
    main()
