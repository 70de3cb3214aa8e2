"""mlxtune against mlx-vlm's trainer on a Qwen2-VL-shaped model: examples/s, tokens/s, memory.

    python bench/compare_mlx_vlm.py              # 60 steps of 8 each, ~2 minutes on a 2-core CPU
    python bench/compare_mlx_vlm.py --steps 30 --hidden 256

Both trainers get the same base (a Qwen2-VL-shaped model built at random by mlxtune's
``write_vision_base``: hidden --hidden, --layers blocks, a two-block vision tower, Qwen2-VL's
151,936-token vocabulary unless --vocab says otherwise; the tokenizer uses its first 263), the same
chats with images (recipes/data/colours: the colour of a shape, one image a chat), the same LoRA
(rank 8, scale 2, every linear layer of the language model, the tower frozen), Adam at a
constant rate without weight decay, batches of --batch and --steps steps; both train the
assistant's answer only (mlx-vlm's ``--train-on-completions``). Each runs in its own process,
OpenBLAS set up by importing mlxtune first in both.

Throughput is counted the same way for both: examples a second, over the steps after the first
third (compilation left out), and valid tokens a second (examples/s times the examples' mean
real length, the same data for both). Memory: MLX's peak (as each reports it) and the child's
maximum RSS. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
COLOURS = REPO / "recipes" / "data" / "colours"
TAG = "COMPARE_MLX_VLM "


def arch(hidden: int, layers: int, vocab: int) -> dict:
    return {
        "model_type": "qwen2_vl",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": max(hidden // 64, 1),
        "num_key_value_heads": max(hidden // 128, 1),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 128,
            "hidden_size": hidden,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }


def write_data(out: Path) -> float:
    """train.jsonl and valid.jsonl with absolute image paths (both trainers read them): the
    examples' mean real length in tokens is returned by the mlxtune child."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid"):
        rows = []
        for line in (COLOURS / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            for m in row["messages"]:
                for part in m["content"] if isinstance(m["content"], list) else ():
                    if part.get("type") == "image":
                        part["image"] = str(COLOURS / part["image"])
            rows.append(row)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def mlxtune_mx():
    """mlx.core, once mlxtune has set up OpenBLAS (an import sorter would put ``import mlx.core``
    before ``import mlxtune``, and MLX would then multiply with its bundled reference BLAS)."""
    import importlib

    return importlib.import_module("mlx.core")


def child_mlxtune(spec: dict) -> dict:
    import mlxtune  # first: OpenBLAS for MLX's CPU backend, before mlx.core loads
    from mlxtune.console import Console

    mx = mlxtune_mx()

    r = {
        "name": "bench-vision",
        "model": {"path": spec["base"]},
        "data": {"train": spec["data"] + "/train.jsonl", "valid": spec["data"] + "/valid.jsonl",
                 "max_length": 128},
        "adapter": {"type": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "optimizer": {"name": "adam", "lr": spec["lr"], "weight_decay": 0.0, "grad_clip": None,
                      "bias_correction": False},  # mlx's Adam, as mlx-vlm runs it
        "schedule": {"name": "constant", "warmup_steps": 0},
        "train": {"batch_size": spec["batch"], "max_steps": spec["steps"],
                  "log_every": spec["steps"] // 3, "progress": False, "seed": 0},
        "eval": {"every": None},
        "checkpoints": {"every": None, "keep_last": 1},
    }  # fmt: skip
    tr = mlxtune.Trainer(
        mlxtune.recipe_from_dict(r), run_dir=Path(spec["work"]) / "mlxtune",
        console=Console(quiet=True),
    )  # fmt: skip
    tr.run()
    rows = [x for x in tr.run_dir.read_jsonl("metrics.jsonl") if "loss" in x]
    steady = rows[1:]
    step_s = sum(x["step_time_s"] for x in steady) / len(steady)
    lengths = [len(e.ids) for e in tr.train_set.examples]
    return {
        "examples_per_sec": spec["batch"] / step_s,
        "mean_tokens": sum(lengths) / len(lengths),
        "peak_memory_gb": max(x["peak_memory_gb"] for x in rows),
        "mlx_peak_gb": mx.get_peak_memory() / 1e9,
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
    }


def child_mlx_vlm(spec: dict) -> dict:
    import io
    import runpy
    from contextlib import redirect_stdout

    import mlxtune  # noqa: F401  (first: OpenBLAS for MLX's CPU backend, as for mlxtune)

    mx = mlxtune_mx()

    every = spec["steps"] // 3
    sys.argv = [
        "mlx_vlm.train", "--model", spec["base"], "--data", spec["data"],
        "--iters", str(spec["steps"]), "--batch-size", str(spec["batch"]),
        "--learning-rate", str(spec["lr"]), "--optimizer", "adam", "--weight-decay", "0",
        "--train-type", "lora", "--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0",
        "--steps-per-report", str(every), "--steps-per-eval", str(10 * spec["steps"]),
        "--val-batches", "1", "--train-on-completions", "--max-seq-length", "128",
        "--output-path", str(Path(spec["work"]) / "mlx-vlm"),
    ]  # fmt: skip
    out = io.StringIO()
    with redirect_stdout(out):
        runpy.run_module("mlx_vlm.train", run_name="__main__")
    text = out.getvalue()
    blocks = re.split(r"Training \(iteration \d+\):", text)[1:]
    if not blocks:
        raise RuntimeError("mlx-vlm's trainer printed no report:\n" + text[-3000:])

    def figure(block, key):
        found = re.search(rf"\b{key}=([\d,.]+)", block)
        return float(found.group(1).replace(",", "")) if found else None

    # its figures are totals since the start: the rate of the last report window (past
    # compilation) is the difference of the last two reports
    prev, last = blocks[-2], blocks[-1]
    sequences = figure(last, "total_sequences") - figure(prev, "total_sequences")
    return {
        "examples_per_sec": sequences / (figure(last, "train_time") - figure(prev, "train_time")),
        "peak_memory_gb": figure(last, "peak_memory"),
        "mlx_peak_gb": mx.get_peak_memory() / 1e9,
        "loss_first": figure(blocks[0], "train_loss"),
        "loss_last": figure(last, "train_loss"),
    }


def run_child(which: str, spec: dict) -> dict:
    p = subprocess.run(
        [sys.executable, __file__, "--child", which, json.dumps(spec)],
        capture_output=True, text=True, timeout=3600, cwd=REPO,
    )  # fmt: skip
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    raise RuntimeError(f"{which} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--vocab", type=int, default=151936, help="the model's vocabulary (Qwen2-VL's: 151,936)"
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--child", choices=["mlxtune", "mlx-vlm"], help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.spec)
        got = (child_mlxtune if args.child == "mlxtune" else child_mlx_vlm)(spec)
        got["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(TAG + json.dumps(got))
        return 0

    import mlxtune  # noqa: F401
    from mlxtune.models import write_vision_base
    from mlxtune.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="compare-mlx-vlm-") as tmp:
        tmp = Path(tmp)
        tok_dir = COLOURS / "tokenizer"
        base = write_vision_base(
            arch(args.hidden, args.layers, args.vocab),
            load_tokenizer(tok_dir),
            tok_dir,
            tmp / "base",
            0,
        )
        write_data(tmp / "data")
        spec = {"base": str(base), "data": str(tmp / "data"), "steps": args.steps,
                "batch": args.batch, "lr": args.lr, "work": str(tmp)}  # fmt: skip
        ours = run_child("mlxtune", spec)
        peer = run_child("mlx-vlm", spec)
    for r in (ours, peer):
        r["valid_tokens_per_sec"] = r["examples_per_sec"] * ours["mean_tokens"]
    ratios = {
        "examples/s, mlxtune / mlx-vlm": ours["examples_per_sec"] / peer["examples_per_sec"],
        "MLX peak, mlxtune / mlx-vlm": ours["mlx_peak_gb"] / peer["mlx_peak_gb"],
        "max RSS, mlxtune / mlx-vlm": ours["max_rss_gb"] / peer["max_rss_gb"],
    }
    print(f"{'':24}{'mlxtune':>12}{'mlx-vlm':>12}")
    for k in ("examples_per_sec", "valid_tokens_per_sec", "mlx_peak_gb", "max_rss_gb",
              "loss_first", "loss_last"):  # fmt: skip
        print(f"{k:24}{ours[k]:>12.3f}{peer[k]:>12.3f}")
    for k, v in ratios.items():
        print(f"{k:36} {v:.2f}x")
    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
             "steps": args.steps, "batch": args.batch}  # fmt: skip
    print(json.dumps({"model": shape, "mlxtune": ours, "mlx_vlm": peer,
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "cores": os.cpu_count()}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
