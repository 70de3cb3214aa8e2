"""Tensor parallelism's LM head: kept whole on every rank, or split by vocabulary among them,
measured in the same run on two ranks of MLX's ring backend.

    python bench/tensor_head.py                        # vocabulary 131,072, hidden 1024
    python bench/tensor_head.py --vocab 49152 --hidden 576

A llama of 2 blocks (its heads and MLP columns split between the ranks in both cases) with a
large vocabulary and an untied head, full fine-tuning with AdamW in fp32, 2 rows of 256
tokens: each rank computes the hidden states, the loss through the loss kernel (``--impl``;
the whole head: ``linear_cross_entropy``; the split head: ``split_cross_entropy``, which the
trainer uses) and the update. For each case, the rank's peak memory over 3 steps (MLX's own
counter, reset before them) and the median step time. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def worker(args) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from mlxtune.kernels import linear_cross_entropy
    from mlxtune.models import build_model, lm_parts
    from mlxtune.tensor import shard_tensors, split_cross_entropy, split_head, vocab_split

    group = mx.distributed.init()
    out = {}
    for case in ("whole", "split"):
        arch = {
            "model_type": "llama",
            "hidden_size": args.hidden,
            "num_hidden_layers": 2,
            "intermediate_size": args.hidden * 11 // 4,
            "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": max(args.hidden // 256, 2),
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        }
        model, _ = build_model(arch, args.vocab, seed=0)
        model.unfreeze()
        lm = lm_parts(model)
        shard_tensors(model, group)
        if case == "split":
            split_head(model, lm.head_path, lm.softcap, group)
        mx.eval(model.parameters())
        opt = optim.AdamW(1e-4)
        tokens = mx.random.randint(0, args.vocab, (2, 257), key=mx.random.key(1))
        targets = tokens[:, 1:].reshape(-1)
        where = vocab_split(lm.head)

        def loss(m, lm=lm, tokens=tokens, targets=targets, where=where):
            h = lm.hidden(tokens[:, :-1])
            h = h.reshape(-1, h.shape[-1])
            if where is None:
                return linear_cross_entropy(h, lm.head_weight(), targets, impl=args.impl)[0]
            return split_cross_entropy(
                h, lm.head_weight(), targets, where, ignore_index=-100,
                label_smoothing=0.0, reduction="sum", impl=args.impl,
            )[0]  # fmt: skip

        grad = nn.value_and_grad(model, loss)
        times = []
        mx.eval(opt.state)
        mx.reset_peak_memory()
        for _ in range(args.steps):
            t = time.perf_counter()
            value, grads = grad(model)
            opt.update(model, grads)
            mx.eval(value, model.parameters(), opt.state)
            times.append(time.perf_counter() - t)
            del grads
        out[case] = {
            "peak_gb": mx.get_peak_memory() / 1e9,
            "step_s": statistics.median(times[1:] or times),
            "loss": value.item() / targets.size,
        }
        del model, opt, grad
        mx.clear_cache()
    if group.rank() == 0:
        Path(args.out).write_text(json.dumps(out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--impl", default="reference", help="the loss kernel's tier")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out:
        return worker(args)
    from mlxtune.distributed import launch_local

    out = Path("/tmp") / f"tensor-head-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
    cmd += ["--steps", str(args.steps), "--impl", args.impl, "--out", str(out)]
    # the ranks as `mlxtune run --nproc 2` starts them (mlx.launch's output loop takes a core)
    if launch_local(2, cmd) or not out.exists():
        raise SystemExit("the ranks failed (their output is above)")
    got = json.loads(out.read_text())
    out.unlink()
    w, s = got["whole"], got["split"]
    print(f"vocabulary {args.vocab}, hidden {args.hidden}, 2 ranks, 2 x 256 tokens:")
    print("| head | rank's peak | step | loss |")
    print("| --- | ---: | ---: | ---: |")
    for case, r in got.items():
        print(f"| {case} | {r['peak_gb']:.2f} GB | {r['step_s']:.2f} s | {r['loss']:.4f} |")
    print(
        f"split / whole: peak {s['peak_gb'] / w['peak_gb']:.2f}x, "
        f"step {s['step_s'] / w['step_s']:.2f}x"
    )
    print(json.dumps({"vocab": args.vocab, "hidden": args.hidden, **got}))


if __name__ == "__main__":
    main()
