"""Optimizers on the quickstart tasks: steps to the accuracy target and wall time, per optimizer.

    python bench/optimizers.py                 # quickstart and quickstart-lora, every optimizer
    python bench/optimizers.py --recipe quickstart --optimizers adamw,lion

Each run is the shipped recipe with only the optimizer changed (its name, learning rate and weight
decay from ``SETTINGS``, everything else as shipped), evaluated every ``--every`` steps on the
recipe's held-out exact match (``eval.exact_match`` prompts, greedy, by a callback). It reports
the first evaluated step whose exact match reaches ``--target`` (0.9, the quickstarts' target),
the training seconds to that step (wall time from the first step, the evaluations' own time left
out), the final exact match and the final training loss. One process, the runs one after another;
nothing here is a peer comparison (there is no other trainer to run the same optimizers on the
same recipe), so it prints a table and a last JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxtune  # noqa: E402,F401  (first: its OpenBLAS and malloc set-up)

REPO = Path(__file__).resolve().parents[1]

# (name, lr, weight_decay) per recipe: adamw as shipped; Lion at a lower lr with a larger decay
# (its paper's advice: 3-10x lower); Adafactor (unscaled, its default here) at AdamW's lr
SETTINGS = {
    "quickstart": {
        "adamw": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
        "lion": {"name": "lion", "lr": 2e-4, "weight_decay": 0.1},
        "adafactor": {"name": "adafactor", "lr": 2e-3, "weight_decay": 0.0},
        "muon": {"name": "muon", "lr": 2e-3, "weight_decay": 0.01},
        "sophia": {"name": "sophia", "lr": 3e-4, "weight_decay": 0.01},
        "adamw8bit": {"name": "adamw8bit", "lr": 2e-3, "weight_decay": 0.01},
    },
    "quickstart-lora": {  # the shipped lr, 2e-3, times LR_FACTOR
        "adamw": {"name": "adamw", "lr": None, "weight_decay": None},
        "lion": {"name": "lion", "lr": None, "weight_decay": 0.0},
        "adafactor": {"name": "adafactor", "lr": None, "weight_decay": 0.0},
        "muon": {"name": "muon", "lr": None, "weight_decay": None},  # adapters under Muon
        "muon-adamw-adapters": {
            "name": "muon",
            "lr": None,
            "weight_decay": None,
            "set": ["optimizer.muon.adapters=false"],
        },
        "sophia": {"name": "sophia", "lr": None, "weight_decay": None},
        "adamw-lora-plus": {
            "name": "adamw",
            "lr": None,
            "weight_decay": None,
            "set": ["adapter.lora_plus_ratio=16"],
        },
    },
}
LR_FACTOR = {"lion": 0.3, "sophia": 0.3}


def run(recipe: str, opt: str, every: int, target: float, tmp: Path, extra=()) -> dict:
    from mlxtune import Callback, Trainer, load_recipe
    from mlxtune.console import Console
    from mlxtune.evaluate import exact_match

    base = load_recipe(REPO / "recipes" / f"{recipe}.yaml")
    s = dict(SETTINGS[recipe][opt])
    lr = s["lr"] if s["lr"] is not None else base.optimizer.lr * LR_FACTOR.get(opt, 1.0)
    wd = s["weight_decay"] if s["weight_decay"] is not None else base.optimizer.weight_decay
    overrides = [
        f"optimizer.name={s['name']}",
        f"optimizer.lr={lr}",
        f"optimizer.weight_decay={wd}",
        "eval.every=null",
        "samples.every=null",
        "export.formats=[]",
        "checkpoints.save_best=false",
        *s.get("set", []),
        *extra,
    ]
    r = load_recipe(REPO / "recipes" / f"{recipe}.yaml", overrides)
    lr, wd = r.optimizer.lr, r.optimizer.weight_decay  # as run (an extra override may set them)
    seen: list[tuple[int, float, float]] = []  # (step, exact match, training seconds so far)
    clock = {"t0": 0.0, "evals": 0.0}

    class Every(Callback):
        """The held-out exact match every ``every`` steps, its own time kept off the clock."""

        def on_train_start(self, trainer):
            clock["t0"] = time.perf_counter()

        def on_step(self, trainer, event):
            if event.step % every:
                return
            t = time.perf_counter()
            n = trainer.recipe.eval.exact_match
            examples = [e for e in trainer.test_set.examples if e.prompt_ids][:n]
            acc, _ = exact_match(
                trainer.model, trainer.tokenizer, examples, trainer.recipe.eval.max_new_tokens
            )
            seen.append((event.step, acc, t - clock["t0"] - clock["evals"]))
            clock["evals"] += time.perf_counter() - t

    tr = Trainer(
        r, run_dir=tmp / f"{recipe}-{opt}", console=Console(quiet=True), callbacks=[Every()]
    )
    summary = tr.run()
    reached = next(((step, sec) for step, acc, sec in seen if acc >= target), (None, None))
    return {
        "recipe": recipe,
        "optimizer": opt,
        "lr": lr,
        "weight_decay": wd,
        "set": [*s.get("set", []), *extra],
        "steps": summary["steps"],
        "target": target,
        "step_reaching_target": reached[0],
        "train_s_to_target": round(reached[1], 2) if reached[1] is not None else None,
        "train_s": summary["train_time_s"],
        "exact_match_by_step": {step: acc for step, acc, _ in seen},
        "exact_match_final": summary.get("exact_match_after"),
        "final_loss": summary.get("final_loss"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", action="append", choices=sorted(SETTINGS))
    ap.add_argument("--optimizers", help="comma-separated; default: every one in SETTINGS")
    ap.add_argument("--every", type=int, default=50, help="steps between evaluations")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--set", action="append", default=[], help="another recipe override")
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="mlxtune-optimizers-") as tmp:
        for recipe in args.recipe or sorted(SETTINGS):
            for opt in (args.optimizers or ",".join(SETTINGS[recipe])).split(","):
                res = run(recipe, opt, args.every, args.target, Path(tmp), args.set)
                out.append(res)
                print(
                    f"{recipe:16} {opt:10} lr {res['lr']:<8g} steps to {args.target:.0%}: "
                    f"{res['step_reaching_target']}, train s to it "
                    f"{res['train_s_to_target']}, final exact match "
                    f"{res['exact_match_final']}, loss {res['final_loss']:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
    print(json.dumps({"runs": out, "every": args.every, "target": args.target}))


if __name__ == "__main__":
    main()
