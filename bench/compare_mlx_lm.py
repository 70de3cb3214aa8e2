"""mlxtune against mlx-lm's LoRA trainer: the same model, data and LoRA, in one process.

    python bench/compare_mlx_lm.py            # about 5 minutes on a 2-core CPU
    python bench/compare_mlx_lm.py --quick    # under 2 minutes

Both trainers get the same base weights, the same encoded examples (tokens and prompt masks),
the same LoRA (rank, scale, layers), Adam with a constant learning rate and no clipping, and the
same number of steps and batch size. Throughput counts valid target tokens only; mlx-lm's loss
mask counts one position past each sequence as well, which is taken off its count. The first
report window (compilation) is left out of both figures. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlxtune  # noqa: F401  (first: picks up OpenBLAS before mlx loads)

# isort: split
import mlx.core as mx
import mlx.optimizers as optim

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "recipes" / "data" / "reverse"
TOKENIZER = REPO / "recipes" / "models" / "reverse-tiny"

SIZES = {
    "quick": dict(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=8,
        steps=40,
        batch=16,
        report=10,
    ),
    "full": dict(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1024,
        num_attention_heads=8,
        steps=100,
        batch=32,
        report=20,
    ),
}


def build_base(out: Path, size: dict) -> Path:
    from mlxtune.models import build_model, save_model
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    arch = dict(
        model_type="llama",
        hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_hidden_layers"],
        intermediate_size=size["intermediate_size"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_attention_heads"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model, config = build_model(arch, len(tok._tokenizer), seed=0)
    return save_model(model, config, out, tok, TOKENIZER)


def run_mlxtune(base: Path, size: dict, run_dir: Path, rank: int, lr: float) -> dict:
    from mlxtune import Trainer, recipe_from_dict

    recipe = recipe_from_dict(
        {
            "name": "bench",
            "model": {"path": str(base)},
            "data": {"train": str(DATA / "train.jsonl"), "valid": str(DATA / "valid.jsonl")},
            "adapter": {
                "type": "lora",
                "rank": rank,
                "alpha": 2.0 * rank,
                "targets": ["q_proj", "v_proj"],
            },
            "optimizer": {"name": "adam", "lr": lr, "grad_clip": None, "bias_correction": False},
            "schedule": {"name": "constant"},
            "train": {
                "batch_size": size["batch"],
                "max_steps": size["steps"],
                "log_every": size["report"],
                "progress": False,
            },
            "eval": {"every": None, "max_batches": 1},
            "checkpoints": {"save_final": False, "save_best": False},
        }
    )
    from mlxtune.console import Console

    trainer = Trainer(recipe, run_dir=run_dir, console=Console(quiet=True))
    mx.reset_peak_memory()
    trainer.run()
    rows = [r for r in trainer.run_dir.read_jsonl("metrics.jsonl") if "tokens_per_sec" in r]
    steady = rows[1:] or rows
    tokens = sum(r["tokens_per_sec"] * r["step_time_s"] * size["report"] for r in steady)
    seconds = sum(r["step_time_s"] * size["report"] for r in steady)
    return {
        "tokens_per_sec": tokens / seconds,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "examples": trainer.train_set.examples,
    }


def run_mlx_lm(base: Path, size: dict, examples, rank: int, lr: float) -> dict:
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(base))
    model.freeze()
    linear_to_lora_layers(
        model,
        len(model.layers),
        {
            "rank": rank,
            "scale": 2.0,
            "dropout": 0.0,
            "keys": ["self_attn.q_proj", "self_attn.v_proj"],
        },
    )
    # The same encoded examples as mlxtune: (tokens, index of the first target).
    data = [(e.ids, e.mask.index(1)) for e in examples]

    class Record(TrainingCallback):
        def __init__(self):
            self.rows = []

        def on_train_loss_report(self, info):
            self.rows.append(info)

    rec = Record()
    args = TrainingArgs(
        batch_size=size["batch"],
        iters=size["steps"],
        steps_per_report=size["report"],
        steps_per_eval=10**9,
        steps_per_save=10**9,
        max_seq_length=2048,
        adapter_file=str(Path(tempfile.mkdtemp()) / "a.safetensors"),
    )
    mx.reset_peak_memory()
    train(model, optim.Adam(learning_rate=lr), data, None, args=args, training_callback=rec)
    steady = rec.rows[1:] or rec.rows
    per_window_examples = size["batch"] * size["report"]
    # tokens_per_second counts one extra (padding) target per example; take it off.
    valid = []
    for r in steady:
        window_s = r["iterations_per_second"] and size["report"] / r["iterations_per_second"]
        valid.append((r["tokens_per_second"] * window_s - per_window_examples, window_s))
    return {
        "tokens_per_sec": sum(t for t, _ in valid) / sum(s for _, s in valid),
        "peak_gb": mx.get_peak_memory() / 1e9,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="a smaller model and fewer steps (under two minutes)"
    )
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(Path(tmp) / "base", size)
        t0 = time.time()
        ours = run_mlxtune(base, size, Path(tmp) / "run", args.rank, args.lr)
        theirs = run_mlx_lm(base, size, ours.pop("examples"), args.rank, args.lr)
        elapsed = time.time() - t0
    print(
        f"model: llama {size['hidden_size']}x{size['num_hidden_layers']}, batch {size['batch']}, {size['steps']} steps, "
        f"LoRA r={args.rank} on q_proj/v_proj; data: {DATA.relative_to(REPO)} (mixed lengths)",
        file=sys.stderr,
    )
    print(f"{'':10} {'valid tok/s':>12} {'peak GB':>9}", file=sys.stderr)
    print(f"{'mlxtune':10} {ours['tokens_per_sec']:12,.0f} {ours['peak_gb']:9.3f}", file=sys.stderr)
    print(
        f"{'mlx-lm':10} {theirs['tokens_per_sec']:12,.0f} {theirs['peak_gb']:9.3f}", file=sys.stderr
    )
    print(
        f"ratio      {ours['tokens_per_sec'] / theirs['tokens_per_sec']:12.2f}x {ours['peak_gb'] / theirs['peak_gb']:8.2f}x"
        f"   (mlxtune / mlx-lm; {elapsed:.0f} s)",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "mlxtune_tokens_per_sec": round(ours["tokens_per_sec"], 1),
                "mlx_lm_tokens_per_sec": round(theirs["tokens_per_sec"], 1),
                "mlxtune_peak_gb": round(ours["peak_gb"], 4),
                "mlx_lm_peak_gb": round(theirs["peak_gb"], 4),
                "tokens_per_sec_ratio": round(ours["tokens_per_sec"] / theirs["tokens_per_sec"], 3),
                "peak_memory_ratio": round(ours["peak_gb"] / theirs["peak_gb"], 3),
                "size": "quick" if args.quick else "full",
            }
        )
    )


if __name__ == "__main__":
    main()
