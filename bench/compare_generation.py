"""mlxtune's generation engine against mlx-lm's batch_generate: the same model, prompts, lengths
and sampling, in one process.

    python bench/compare_generation.py            # about a minute on a 2-core CPU
    python bench/compare_generation.py --quick    # about 20 seconds

The model is bench/lora_runs.py's tiny llama (hidden 256, 4 layers, fp32) at a 32,768-token
vocabulary, built at random. Prompts are random words of mixed lengths (the char-level
tokenizer: 40-160 tokens). Every completion runs the full ``--new`` tokens (no stop token on
either side: a random model's EOS would end rows at random), sampled at temperature 1 from each
trainer's own random state. Two workloads:

- groups: ``--prompts`` prompts x 8 completions each (GRPO's shape). mlxtune reads each prompt
  once and copies its cache to the 8 rows; mlx-lm gets each prompt 8 times.
- single: the same prompts, one completion each.

Generated tokens per second (completion tokens over wall time, prompt reading included), the
better of ``--repeats`` runs after a warm-up; the ratio mlxtune/mlx-lm; one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxtune  # noqa: E402,F401  (first: its OpenBLAS and malloc set-up)

GROUP = 8


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(n):
        size = rng.randint(40, 160)
        words = []
        while sum(len(w) + 1 for w in words) < size:
            words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))))
        out.append(" ".join(words)[:size])
    return out


def run_mlxtune(model, prompts: list[list[int]], new: int, group: int, seed: int) -> int:
    import mlx.core as mx

    from mlxtune.generate import Sampling, generate_ids

    out = generate_ids(
        model, prompts, new, set(), sampling=Sampling(temperature=1.0), group=group, seed=seed
    )
    mx.synchronize()
    return sum(len(o) for o in out)


def run_mlx_lm(model, tokenizer, prompts: list[list[int]], new: int, group: int, seed: int) -> int:
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    rows = [p for p in prompts for _ in range(group)]
    res = batch_generate(
        model,
        tokenizer,
        rows,
        max_tokens=new,
        sampler=make_sampler(temp=1.0),
        completion_batch_size=len(rows),
        prefill_batch_size=len(rows),
        return_token_ids=True,
    )
    return sum(len(t) for t in res.token_ids)


def timed(fn, repeats: int) -> tuple[float, int]:
    """(best tokens/s, tokens) over ``repeats`` runs after one warm-up."""
    fn(0)
    best, count = 0.0, 0
    for r in range(repeats):
        t = time.perf_counter()
        count = fn(r + 1)
        best = max(best, count / (time.perf_counter() - t))
    return best, count


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--new", type=int, default=None, help="tokens generated per completion")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args(argv)
    prompts_n = a.prompts or (4 if a.quick else 8)
    new = a.new or (32 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 2)

    import mlx.core as mx
    from lora_runs import build_base
    from mlx_lm import load

    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(Path(tmp) / "base", a.vocab)
        model, tokenizer = load(str(base))
    # no stop token on mlx-lm's side either: every row runs ``new`` tokens
    tokenizer._eos_token_ids = set()
    prompts = [list(tokenizer.encode(t)) for t in prompt_texts(prompts_n)]
    result = {
        "vocab": a.vocab,
        "prompts": prompts_n,
        "new_tokens": new,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "device": str(mx.default_device()),
    }
    print(f"{'workload':<10} {'trainer':<8} {'tok/s':>9} {'tokens':>7}  ratio")
    for name, group in (("groups", GROUP), ("single", 1)):
        ours = timed(lambda s, g=group: run_mlxtune(model, prompts, new, g, s), repeats)
        peer = timed(lambda s, g=group: run_mlx_lm(model, tokenizer, prompts, new, g, s), repeats)
        ratio = ours[0] / peer[0]
        print(f"{name:<10} {'mlxtune':<8} {ours[0]:>9.1f} {ours[1]:>7}  {ratio:.2f}x")
        print(f"{name:<10} {'mlx-lm':<8} {peer[0]:>9.1f} {peer[1]:>7}")
        result[name] = {
            "mlxtune_tokens_per_sec": round(ours[0], 2),
            "mlx_lm_tokens_per_sec": round(peer[0], 2),
            "tokens": ours[1],
            "ratio": round(ratio, 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
