"""mlxtune against mlx-lm's LoRA trainer: the same model, data and LoRA, in one process.

    python bench/compare_mlx_lm.py                 # every workload (about 20 minutes, 2-core CPU)
    python bench/compare_mlx_lm.py --quick         # smaller and shorter (about 7 minutes)
    python bench/compare_mlx_lm.py --workload chat-mixed --vocab 32768

Workloads (each run on a small-vocabulary model and on a 32,768-token one):

- chat-mixed: single-turn chats of widely mixed length, trained on the assistant turn. mlx-lm
  gets them as `mlx_lm.lora` does (in its CacheDataset, whose length sort keeps the file order),
  so each batch is padded to its longest example; `--mlx-lm-sorted` hands it a plain list, which
  it does sort by length. mlxtune runs its defaults: batches sorted by length within buckets of
  16 batches (`--packing pack` packs rows of 1,024 tokens instead). Each report window is one
  epoch (64 training examples with --quick, else 128), so both trainers are timed on the same
  examples; packed rows do not keep to those windows exactly.
- text-fixed: plain text cut to one length, trained on every token. Nothing to pack: this
  measures the step itself.

Both trainers get the same base weights, the same encoded examples (tokens and loss masks), the
same LoRA (rank, scale, q_proj/v_proj of every layer), Adam at a constant rate without clipping,
and the same number of examples. Throughput counts valid target tokens only (mlx-lm's count of one
extra target per example is taken off); the first report window (compilation) is left out. MFU
is the model FLOPs of the real (unpadded) tokens per second over this machine's matmul peak in
the bench's dtype, measured at the start. Prints a table, then one JSON line.

`--model 1b` swaps the small model for a 1B-class one (hidden 2048, 16 layers) and `--dtype
bfloat16` trains it in bf16: sizes for a GPU (see bench/device/README.md), far too slow here.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import mlxtune  # noqa: F401  (first: picks up OpenBLAS before mlx loads)

# isort: split
import mlx.core as mx
import mlx.optimizers as optim

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "recipes" / "models" / "reverse-tiny"  # char-level, with a chat template
LETTERS = "abcdefghijklmnopqrstuvwxyz"

MODELS = {
    # the CPU default: small enough that a full run fits in half an hour on two cores
    "tiny": dict(
        hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=8
    ),
    # about 1B parameters (at vocab 32k), where the linear layers dominate: for a GPU
    "1b": dict(
        hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=16
    ),
}
MODEL = dict(MODELS["tiny"])  # the size in use (main sets it from --model)
DTYPE = "float32"  # the base model's dtype (main sets it from --dtype)
# chat-mixed: one report window is one epoch of `train` examples (train / examples steps), so
# that both trainers are timed on the same examples; the first epoch (compilation) is left out.
QUICK = {
    "chat-mixed": dict(examples=16, steps=12, report=4, train=64),
    "text-fixed": dict(examples=8, steps=12, report=4),
}
FULL = {
    "chat-mixed": dict(examples=16, steps=32, report=8, train=128),
    "text-fixed": dict(examples=8, steps=40, report=10),
}
VALID_FRACTION = 0.02  # mlxtune's held-out split of the data file
TEXT_LENGTH = 256  # tokens per text-fixed example
CHAT_MAX = 1024  # longest chat example; packed rows are this long


def words(rng: random.Random, n_chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append("".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8))))
    return " ".join(out)


def rows_for(train: int) -> int:
    """How many rows the data file needs for ``train`` examples after the held-out split."""
    n = train + 1
    while n - min(max(1, round(n * VALID_FRACTION)), n - 1) < train:
        n += 1
    return n


def write_data(kind: str, path: Path, n: int = 600) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            if kind == "chat-mixed":  # log-uniform lengths: many short, some long
                user = words(rng, int(2 ** rng.uniform(3, 8.5)))
                answer = words(rng, int(2 ** rng.uniform(3, 8.5)))
                row = {
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": answer},
                    ]
                }
            else:
                row = {"text": words(rng, TEXT_LENGTH * 2)}
            f.write(json.dumps(row) + "\n")


def build_base(out: Path, vocab: int | None) -> Path:
    from mlxtune.models import build_model, save_model
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    arch = dict(
        model_type="llama",
        num_key_value_heads=MODEL["num_attention_heads"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        **MODEL,
    )
    model, config = build_model(arch, vocab or len(tok._tokenizer), dtype=DTYPE, seed=0)
    return save_model(model, config, out, tok, TOKENIZER, dtype=DTYPE)


def matmul_peak() -> float:
    """Matmul FLOP/s of this machine under MLX in the bench's dtype (the best of a few n^3
    products: 1024 on a CPU, 8192 on a GPU)."""
    n = 8192 if mx.default_device().type == mx.DeviceType.gpu else 1024
    a = mx.random.normal((n, n)).astype(getattr(mx, DTYPE))
    b = mx.random.normal((n, n)).astype(getattr(mx, DTYPE))
    mx.eval(a @ b)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def flops_per_token(vocab: int, mean_len: float) -> float:
    """LoRA training FLOPs of one token: the forward pass (2 per weight) and the backward pass's
    input gradients (2 per weight; the frozen weights get none of their own), attention included."""
    h, i, L = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    per_layer = 4 * h * h + 3 * h * i
    attention = 2 * h * mean_len  # causal: half of the T x T scores and their product with V
    return 4 * (L * (per_layer + attention) + vocab * h)


def run_mlxtune(
    base, data, kind, cfg, run_dir, rank, lr, packing="off", attention="auto", bucket=16
) -> dict:
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    chat = kind == "chat-mixed"
    recipe = {
        "name": "bench",
        "model": {"path": str(base), "dtype": DTYPE},
        "data": {
            "train": str(data),
            "max_length": CHAT_MAX if chat else TEXT_LENGTH,
            "overlong": "drop" if chat else "truncate",
            "valid_fraction": VALID_FRACTION,
            "bucket_size": bucket,
        },
        "adapter": {
            "type": "lora",
            "rank": rank,
            "alpha": 2.0 * rank,
            "targets": ["q_proj", "v_proj"],
        },
        "optimizer": {"name": "adam", "lr": lr, "grad_clip": None, "bias_correction": False},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": cfg["examples"],
            "max_steps": cfg["steps"],
            "log_every": cfg["report"],
            "progress": False,
        },
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"save_final": False, "save_best": False},
        "memory": {"check": "off"},
        "kernels": {"attention": attention},
    }
    probe = Trainer(
        recipe_from_dict(recipe), run_dir=run_dir / "probe", console=Console(quiet=True)
    )
    examples = probe.train_set.examples
    mean_len = sum(len(e.ids) for e in examples) / len(examples)
    del probe
    if (
        chat and packing == "pack"
    ):  # rows of CHAT_MAX tokens holding about as many examples per step as mlx-lm's batch
        recipe["data"].update(packing="pack")
        recipe["train"]["batch_size"] = max(1, round(cfg["examples"] * mean_len / CHAT_MAX))
    trainer = Trainer(
        recipe_from_dict(recipe), run_dir=run_dir / "run", console=Console(quiet=True)
    )
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    trainer.run()
    peak = mx.get_peak_memory() / 1e9
    rows = [r for r in trainer.run_dir.read_jsonl("metrics.jsonl") if "tokens_per_sec" in r]
    steady = rows[1:] or rows
    tokens = sum(r["tokens_per_sec"] * r["step_time_s"] * cfg["report"] for r in steady)
    seconds = sum(r["step_time_s"] * cfg["report"] for r in steady)
    out = {
        "tokens_per_sec": tokens / seconds,
        "peak_gb": peak,
        "rows_per_step": trainer.recipe.train.batch_size,
        "examples": examples,
        "mean_len": mean_len,
    }
    if chat and packing == "pack":
        out["packing_utilization"] = sum(r["packing_utilization"] for r in steady) / len(steady)
    out["step_split_s"] = step_split(trainer)
    del trainer
    gc.collect()
    mx.clear_cache()
    return out


def step_split(trainer, n: int = 3) -> dict:
    """mlxtune's step in three parts, seconds each (after one warm-up step): building the batch
    on the host, the forward and backward pass, and the optimizer update (unscale, clip, guard,
    AdamW). The trainer fuses the last two into one compiled step; here they run apart."""
    import contextlib
    import math

    from mlxtune.models import kernel_attention

    it, engine = trainer.batches(), trainer.engine
    tier = trainer.tiers["attention"]
    ctx = contextlib.nullcontext() if tier == "off" else kernel_attention(trainer.model, tier)
    total = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    with ctx:
        for i in range(n + 1):
            t0 = time.perf_counter()
            _, b = next(it)
            arrays = engine.arrays(b)
            mx.eval(arrays)
            t1 = time.perf_counter()
            inv = mx.array(1.0 / max(trainer.objective.count(b), 1))
            loss, _, _, grads = engine.grad_step(arrays, inv)
            mx.eval(loss, grads)
            t2 = time.perf_counter()
            norm, ok = engine.apply_step(grads, loss)
            mx.eval(engine.state, norm, ok)
            t3 = time.perf_counter()
            if i:  # the first compiles
                total["data"] += t1 - t0
                total["forward_backward"] += t2 - t1
                total["optimizer"] += t3 - t2
    assert math.isfinite(norm.item())
    return {k: round(v / n, 4) for k, v in total.items()}


class _RawRows:
    """mlx-lm's dataset interface (as its ChatDataset): raw rows by index, and ``process`` to
    encode one. Each raw row is a one-key dict, like a chat row's {"messages": [...]}."""

    def __init__(self, examples):
        self._rows = [{"example": e} for e in examples]

    def __getitem__(self, i):
        return self._rows[i]

    def __len__(self):
        return len(self._rows)

    def process(self, row):
        e = row["example"]
        return (e.ids, e.mask.index(1))


def run_mlx_lm(base, examples, cfg, steps, rank, lr, sorted_batches=False) -> dict:
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset
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
    if sorted_batches:
        # A plain list: iterate_batches measures each example's tokens and sorts by length.
        data = [(e.ids, e.mask.index(1)) for e in examples]
    else:
        # What `mlx_lm.lora` trains on: its dataset wrapped in CacheDataset (raw rows, encoded on
        # first use). CacheDataset.itemlen measures the raw row, a one-key dict for every chat
        # example, so the length sort keeps the file order and each batch is padded to its
        # longest example.
        data = CacheDataset(_RawRows(examples))

    class Record(TrainingCallback):
        def __init__(self):
            self.rows = []

        def on_train_loss_report(self, info):
            self.rows.append(info)

    rec = Record()
    args = TrainingArgs(
        batch_size=cfg["examples"],
        iters=steps,
        steps_per_report=cfg["report"],
        steps_per_eval=10**9,
        steps_per_save=10**9,
        max_seq_length=CHAT_MAX + 1,
        adapter_file=str(Path(tempfile.mkdtemp()) / "a.safetensors"),
    )
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    train(model, optim.Adam(learning_rate=lr), data, None, args=args, training_callback=rec)
    peak = mx.get_peak_memory() / 1e9
    steady = rec.rows[1:] or rec.rows
    per_window_examples = cfg["examples"] * cfg["report"]
    valid = []
    for r in steady:  # tokens_per_second counts one extra target per example; take it off
        window_s = cfg["report"] / r["iterations_per_second"]
        valid.append((r["tokens_per_second"] * window_s - per_window_examples, window_s))
    del model
    gc.collect()
    mx.clear_cache()
    return {"tokens_per_sec": sum(t for t, _ in valid) / sum(s for _, s in valid), "peak_gb": peak}


def one(
    kind, vocab, sizes, tmp: Path, rank, lr, peak, packing="off", attention="auto", bucket=16,
    mlx_lm_sorted=False,
):  # fmt: skip
    cfg = sizes[kind]
    data = tmp / f"{kind}.jsonl"
    if not data.exists():
        write_data(kind, data, rows_for(cfg["train"]) if "train" in cfg else 600)
    base = (
        build_base(tmp / f"base-{vocab}", vocab)
        if not (tmp / f"base-{vocab}").exists()
        else tmp / f"base-{vocab}"
    )
    ours = run_mlxtune(
        base, data, kind, cfg, tmp / f"run-{kind}-{vocab}", rank, lr, packing, attention, bucket
    )
    print(f"  mlxtune  {kind} vocab {vocab or 32}: {ours['tokens_per_sec']:,.0f} tok/s, "
          f"peak {ours['peak_gb']:.2f} GB", file=sys.stderr, flush=True)  # fmt: skip
    examples = ours.pop("examples")
    if "train" in cfg and len(examples) != cfg["train"]:
        raise SystemExit(f"{kind}: {len(examples)} training examples, not {cfg['train']}")
    # the same number of examples: mlx-lm's steps hold cfg["examples"] each
    theirs = run_mlx_lm(base, examples, cfg, cfg["steps"], rank, lr, mlx_lm_sorted)
    print(f"  mlx-lm   {kind} vocab {vocab or 32}: {theirs['tokens_per_sec']:,.0f} tok/s, "
          f"peak {theirs['peak_gb']:.2f} GB", file=sys.stderr, flush=True)  # fmt: skip
    real_per_valid = sum(len(e.ids) for e in examples) / sum(e.n_targets for e in examples)
    v = vocab or 32
    fpt = flops_per_token(v, ours["mean_len"])
    return {
        "workload": kind,
        "vocab": v,
        "mlxtune_tokens_per_sec": round(ours["tokens_per_sec"], 1),
        "mlx_lm_tokens_per_sec": round(theirs["tokens_per_sec"], 1),
        "tokens_per_sec_ratio": round(ours["tokens_per_sec"] / theirs["tokens_per_sec"], 3),
        "mlxtune_peak_gb": round(ours["peak_gb"], 4),
        "mlx_lm_peak_gb": round(theirs["peak_gb"], 4),
        "peak_memory_ratio": round(ours["peak_gb"] / theirs["peak_gb"], 3),
        "mlxtune_mfu": round(ours["tokens_per_sec"] * real_per_valid * fpt / peak, 4),
        "mlx_lm_mfu": round(theirs["tokens_per_sec"] * real_per_valid * fpt / peak, 4),
        "mean_tokens_per_example": round(ours["mean_len"], 1),
        "mlxtune_step_split_s": ours["step_split_s"],
        **(
            {"packing_utilization": round(ours["packing_utilization"], 3)}
            if "packing_utilization" in ours
            else {}
        ),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about 7 minutes)")
    ap.add_argument("--workload", choices=["chat-mixed", "text-fixed", "all"], default="all")
    ap.add_argument(
        "--vocab",
        type=int,
        nargs="*",
        default=None,
        help="model vocabularies (default: the tokenizer's 32, and 32768)",
    )
    ap.add_argument(
        "--packing",
        choices=["pack", "off"],
        default="off",
        help="mlxtune's data.packing for chat-mixed (default: off, mlxtune's default)",
    )
    ap.add_argument("--attention", default="auto", help="mlxtune's kernels.attention")
    ap.add_argument("--bucket-size", type=int, default=16, help="mlxtune's data.bucket_size")
    ap.add_argument(
        "--mlx-lm-sorted",
        action="store_true",
        help="give mlx-lm a plain list, so that its length sort works (mlx_lm.lora's CacheDataset "
        "keeps file order)",
    )
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny",
        help="model size: tiny (256x4, the CPU default) or 1b (2048x16, for a GPU)",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the base model's dtype (bfloat16 is slow on a CPU)",
    )
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    global DTYPE
    MODEL.clear()
    MODEL.update(MODELS[args.model])
    DTYPE = args.dtype
    sizes = QUICK if args.quick else FULL
    kinds = ["chat-mixed", "text-fixed"] if args.workload == "all" else [args.workload]
    vocabs = args.vocab if args.vocab else [None, 32768]
    peak = matmul_peak()
    results = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            for vocab in vocabs:
                results.append(
                    one(
                        kind,
                        vocab,
                        sizes,
                        Path(tmp),
                        args.rank,
                        args.lr,
                        peak,
                        args.packing,
                        args.attention,
                        args.bucket_size,
                        args.mlx_lm_sorted,
                    )
                )
    err = sys.stderr
    print(
        f"model: llama {MODEL['hidden_size']}x{MODEL['num_hidden_layers']} (ffn {MODEL['intermediate_size']}), "
        f"{DTYPE}, LoRA r={args.rank} on q_proj/v_proj; {mx.default_device()}, {DTYPE} matmul "
        f"peak {peak / 1e9:.0f} GFLOP/s; {time.time() - t0:.0f} s",
        file=err,
    )
    print(
        f"{'workload':12} {'vocab':>6} {'mlxtune tok/s':>14} {'mlx-lm tok/s':>13} {'ratio':>6} {'peak GB (ours/theirs)':>22} {'MFU ours/theirs':>16}",
        file=err,
    )
    for r in results:
        print(
            f"{r['workload']:12} {r['vocab']:>6} {r['mlxtune_tokens_per_sec']:14,.0f} {r['mlx_lm_tokens_per_sec']:13,.0f} "
            f"{r['tokens_per_sec_ratio']:5.2f}x {r['mlxtune_peak_gb']:9.3f}/{r['mlx_lm_peak_gb']:.3f} ({r['peak_memory_ratio']:.2f}x) "
            f"{100 * r['mlxtune_mfu']:7.2f}%/{100 * r['mlx_lm_mfu']:.2f}%",
            file=err,
        )
    for r in results:
        sp = r["mlxtune_step_split_s"]
        print(
            f"mlxtune step, {r['workload']} vocab {r['vocab']}: data {sp['data']:.3f} s, "
            f"forward+backward {sp['forward_backward']:.3f} s, optimizer {sp['optimizer']:.3f} s",
            file=err,
        )
    print(
        json.dumps(
            {
                "size": "quick" if args.quick else "full",
                "model": args.model,
                "dtype": DTYPE,
                "device": str(mx.default_device()),
                "mlx_lm_batches": "length-sorted" if args.mlx_lm_sorted else "as mlx_lm.lora",
                "matmul_peak_gflops": round(peak / 1e9, 1),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
