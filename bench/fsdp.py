"""The distributed strategies (``distributed.strategy``: data, fsdp, tensor), two ranks of MLX's
ring backend on this machine: the largest model each trains within a rank's memory budget,
and the step time of each on a model all fit.

    python bench/fsdp.py                      # hidden 1024, budget 4 GB a rank: about 15 minutes
    python bench/fsdp.py --budget-gb 2 --hidden 512

Each trial trains a llama of hidden H and depth L from scratch (random weights) under
``mlxtune run --nproc 2``: full fine-tuning, AdamW, fp32, every block checkpointed, 2 rows of
128 tokens a rank, 4 steps. Its peak is MLX's own counter on rank 0 (``peak_memory_gb`` in
summary.json; the ranks hold the same). A rank's peak grows linearly with the depth, so two
depths give the line; the largest depth under the budget it predicts is then run, and the next
one up, until the measured boundary is found. Every strategy runs in the same invocation, with
the same data, model shapes and settings. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora_runs as bench  # noqa: E402

GB = 1e9
STRATEGIES = ("data", "fsdp", "tensor")


def arch(hidden: int, depth: int) -> dict:
    """A llama shape of this hidden size (heads of 64, a quarter as many key/value heads)."""
    heads = max(hidden // 64, 1)
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": depth,
        "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 4, 1),
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }


def parameters(a: dict, vocab: int) -> int:
    """The llama's parameters, counted from its shape."""
    h, i = a["hidden_size"], a["intermediate_size"]
    kv = a["num_key_value_heads"] * h // a["num_attention_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return a["num_hidden_layers"] * block + vocab * h + h


def recipe(data: Path, a: dict, strategy: str, steps: int) -> dict:
    return {
        "name": f"fsdp-bench-{strategy}",
        "model": {"arch": a, "dtype": "float32"},
        "tokenizer": {"path": str(bench.TOKENIZER)},
        "data": {"train": str(data), "max_length": 129, "overlong": "truncate"},
        "adapter": {"type": "full"},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": 4,
            "max_steps": steps,
            "log_every": 1,
            "progress": False,
            "grad_checkpointing": True,
        },
        "eval": {"every": None, "max_batches": 1, "at_start": False},
        "checkpoints": {"save_final": False, "save_best": False, "every": None},
        "memory": {"check": "off"},
        "distributed": {"strategy": strategy},
    }


def trial(tmp: Path, data: Path, hidden: int, depth: int, strategy: str, steps: int) -> dict:
    """One run of ``strategy`` at this depth: its rank's peak, the median step time."""
    a = arch(hidden, depth)
    name = f"{strategy}-{hidden}x{depth}"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(data, a, strategy, steps)))
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(path), "--run-dir", str(run_dir)]
    t = time.perf_counter()
    p = subprocess.run([*cmd, "--nproc", "2"], capture_output=True, text=True)
    took = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_time_s"] for r in rows if "step_time_s" in r)[:-1] or [0.0]
    plan = json.loads((run_dir / "config_resolved.json").read_text())["derived"]
    out = {
        "strategy": strategy,
        "depth": depth,
        "parameters": parameters(a, bench_vocab()),
        "peak_gb": summary["peak_memory_gb"],
        "plan_gb": plan.get("estimated_peak_memory_gb"),
        "step_s": times[len(times) // 2],
        "wall_s": round(took, 1),
    }
    print(
        f"  {strategy:5} depth {depth:3}: {out['parameters'] / 1e6:6.0f}M parameters, peak "
        f"{out['peak_gb']:.2f} GB (plan {out['plan_gb']}), step {out['step_s']:.2f} s",
        flush=True,
    )
    return out


def bench_vocab() -> int:
    from mlxtune.tokenizer import load_tokenizer

    return len(load_tokenizer(bench.TOKENIZER)._tokenizer)


def largest(tmp, data, hidden, strategy, budget, steps, seen) -> dict:
    """The deepest model of ``strategy`` whose measured peak fits ``budget``: two depths give
    the line, the depth it predicts and its neighbours are measured."""

    def at(depth: int) -> dict:
        if depth not in seen:
            seen[depth] = trial(tmp, data, hidden, depth, strategy, steps)
        return seen[depth]

    a, b = at(2), at(6)
    slope = (b["peak_gb"] - a["peak_gb"]) / 4
    guess = max(2, int(2 + (budget - a["peak_gb"]) / slope)) if slope > 0 else 6
    while at(guess)["peak_gb"] > budget and guess > 2:
        guess -= 1
    while at(guess + 1)["peak_gb"] <= budget:
        guess += 1
    return at(guess)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gb", type=float, default=4.0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--depth", type=int, help="only time each strategy at this depth (no search)")
    args = ap.parse_args(argv)
    if args.depth:
        return timed(args)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        data = tmp / "train.jsonl"
        bench.write_data("text-fixed", data, 64)
        found, seen = {}, {s: {} for s in STRATEGIES}
        for s in STRATEGIES:
            found[s] = largest(tmp, data, args.hidden, s, args.budget_gb, args.steps, seen[s])
        # the step time of both on the model data parallelism fits
        depth = found["data"]["depth"]
        both = {s: seen[s].get(depth) or trial(tmp, data, args.hidden, depth, s, args.steps)
                for s in STRATEGIES}  # fmt: skip
    ratio = found["fsdp"]["parameters"] / found["data"]["parameters"]
    slower = both["fsdp"]["step_s"] / max(both["data"]["step_s"], 1e-9)
    print(f"\nlargest model within {args.budget_gb:g} GB a rank (2 ranks, hidden {args.hidden}):")
    print("| strategy | depth | parameters | rank's peak | plan |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for s in STRATEGIES:
        f = found[s]
        print(
            f"| {s} | {f['depth']} | {f['parameters'] / 1e6:.0f}M | {f['peak_gb']:.2f} GB | "
            f"{f['plan_gb']} GB |"
        )
    print(f"fsdp holds {ratio:.2f}x the parameters of data parallelism")
    tensor_ratio = found["tensor"]["parameters"] / found["data"]["parameters"]
    print(f"tensor holds {tensor_ratio:.2f}x the parameters of data parallelism")
    print(
        f"step time at depth {depth}: "
        + ", ".join(f"{s} {both[s]['step_s']:.2f} s" for s in STRATEGIES)
        + f" (fsdp {slower:.2f}x data)"
    )
    print(
        json.dumps(
            {
                "budget_gb": args.budget_gb,
                "hidden": args.hidden,
                "largest": found,
                "fsdp_over_data_parameters": round(ratio, 3),
                "tensor_over_data_parameters": round(tensor_ratio, 3),
                "step_time_depth": depth,
                "step_s": {s: both[s]["step_s"] for s in STRATEGIES},
                "fsdp_step_time_ratio": round(slower, 3),
                "tensor_step_time_ratio": round(
                    both["tensor"]["step_s"] / max(both["data"]["step_s"], 1e-9), 3
                ),
                "trials": {s: list(seen[s].values()) for s in STRATEGIES},
            }
        )
    )


def timed(args) -> None:
    """Each strategy at one depth, one after the other: the step times alone."""
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        data = tmp / "train.jsonl"
        bench.write_data("text-fixed", data, 64)
        got = {s: trial(tmp, data, args.hidden, args.depth, s, args.steps) for s in STRATEGIES}
    base = got["data"]["step_s"]
    print(
        f"step time at hidden {args.hidden}, depth {args.depth}: "
        + ", ".join(f"{s} {got[s]['step_s']:.2f} s ({got[s]['step_s'] / base:.2f}x)" for s in got)
    )
    print(json.dumps({"hidden": args.hidden, "depth": args.depth, "trials": got}))


if __name__ == "__main__":
    main()
