"""mlxtune data-parallel: one process against two on the same work, on MLX's ring backend.

    python bench/scaling.py            # the tiny llama, LoRA and full fine-tuning (about 4 minutes)
    python bench/scaling.py --steps 40

For each setting the same recipe runs as ``mlxtune run`` (one process) and ``mlxtune run
--nproc 2`` (two processes on this machine, each with half the cores' BLAS threads), and the
valid tokens/s of every report window after the first (compilation) give the scaling ratio.
Then, in two processes again, one rank's forward+backward over its half of a batch and the
all-reduce of its gradients alone (``mlx.nn.average_gradients``) are timed, for the all-reduce's
share of a step, and the bytes a step moves are printed with what they would take over 10 GbE
and Thunderbolt 5. Prints a table, then one JSON line.

The model is lora_runs's tiny llama (hidden 256, 4 layers, the char tokenizer's 32 tokens),
on fixed-length text of 256 tokens, 8 examples a step, fp32: LoRA r=8 on q_proj/v_proj (small
gradients) and full fine-tuning (3.3M parameters, 13 MB of fp32 gradients a step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora_runs as bench  # noqa: E402

LINKS = {"10 GbE": 10e9 / 8, "Thunderbolt 5 (80 Gb/s)": 80e9 / 8}


def recipe(base: Path, data: Path, adapter: str, steps: int, report: int) -> dict:
    lora = {"type": "lora", "rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj"]}
    return {
        "name": "scaling",
        "model": {"path": str(base), "dtype": "float32"},
        "data": {
            "train": str(data),
            "max_length": bench.TEXT_LENGTH,
            "overlong": "truncate",
            "valid_fraction": bench.VALID_FRACTION,
        },
        "adapter": lora if adapter == "lora" else {"type": "full"},
        "optimizer": {"name": "adam", "lr": 1e-4, "grad_clip": None},
        "schedule": {"name": "constant"},
        "train": {"batch_size": 8, "max_steps": steps, "log_every": report, "progress": False},
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"save_final": False, "save_best": False},
        "memory": {"check": "off"},
    }


def tokens_per_sec(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return bench.steady_tokens_per_sec(rows)


def run(path: Path, run_dir: Path, nproc: int) -> float:
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(path), "--run-dir", str(run_dir)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return time.perf_counter() - t


def probe(path: Path, reps: int, result: Path) -> None:
    """Under mlx.launch: time this rank's forward+backward and the gradients' all-reduce."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxtune import Trainer, load_recipe
    from mlxtune.console import Console
    from mlxtune.models import kernel_attention

    tr = Trainer(load_recipe(path), dry_run=True, console=Console(quiet=True))
    world, eng = tr.world, tr.engine
    _, batch = next(tr.batches())
    arrays = eng.arrays(eng.shard(batch))
    inv = mx.array(world.size / batch.n_targets)
    reduce = mx.compile(lambda g: nn.average_gradients(g, world.group))
    grad_s, reduce_s = [], []
    with kernel_attention(tr.model, tr.tiers["attention"]):
        for i in range(reps + 2):
            world.barrier()
            t = time.perf_counter()
            out = eng.grad_step(arrays, inv)
            mx.eval(out)
            g = time.perf_counter() - t
            world.barrier()
            t = time.perf_counter()
            mx.eval(reduce(out[3]))
            r = time.perf_counter() - t
            if i >= 2:  # two warm-ups (compilation)
                grad_s.append(g)
                reduce_s.append(r)
    n_bytes = sum(v.nbytes for _, v in tree_flatten(out[3]))
    if world.main:
        result.write_text(
            json.dumps(
                {
                    "forward_backward_s": statistics.median(grad_s),
                    "all_reduce_s": statistics.median(reduce_s),
                    "gradient_bytes": n_bytes,
                }
            )
        )


def launch_probe(path: Path, reps: int) -> dict:
    from mlxtune.distributed import launch_local

    out = path.with_suffix(".probe.json")
    cmd = [sys.executable, __file__, "--probe", str(path), "--reps", str(reps), "--out", str(out)]
    if launch_local(2, cmd) or not out.exists():
        raise SystemExit("the probe failed (its output is above)")
    return json.loads(out.read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="steps per run (report every 4)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of the probe")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        probe(Path(args.probe), args.reps, Path(args.out))
        return
    report = 4
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = bench.build_base(tmp / "base", None)
        data = tmp / "text.jsonl"
        bench.write_data("text-fixed", data, 600)
        for adapter in ("lora", "full"):
            path = tmp / f"{adapter}.yaml"
            path.write_text(yaml.safe_dump(recipe(base, data, adapter, args.steps, report)))
            one = tmp / f"{adapter}-1"
            two = tmp / f"{adapter}-2"
            run(path, one, 1)
            run(path, two, 2)
            t1, t2 = tokens_per_sec(one), tokens_per_sec(two)
            p = launch_probe(path, args.reps)
            share = p["all_reduce_s"] / (p["forward_backward_s"] + p["all_reduce_s"])
            sent = p["gradient_bytes"]  # a ring all-reduce sends 2 (n-1)/n of it per rank: n=2
            res = {
                "adapter": adapter,
                "one_process_tokens_per_sec": round(t1, 1),
                "two_process_tokens_per_sec": round(t2, 1),
                "scaling": round(t2 / t1, 3),
                "rank_forward_backward_s": round(p["forward_backward_s"], 4),
                "all_reduce_s": round(p["all_reduce_s"], 4),
                "all_reduce_share": round(share, 4),
                "gradient_bytes_per_step": sent,
                "link_seconds_per_step": {k: round(sent / bw, 6) for k, bw in LINKS.items()},
            }
            results.append(res)
            print(
                f"{adapter:5} 1 process {t1:8.0f} tok/s, 2 processes {t2:8.0f} tok/s: "
                f"{t2 / t1:.2f}x; a rank's forward+backward {p['forward_backward_s'] * 1e3:.1f} ms, "
                f"all-reduce {p['all_reduce_s'] * 1e3:.2f} ms ({100 * share:.1f}%), "
                f"{sent / 1e6:.2f} MB a step "
                + ", ".join(f"{k} {sent / bw * 1e3:.2f} ms" for k, bw in LINKS.items()),
                file=sys.stderr,
            )
    import mlx.core as mx

    print(json.dumps({"device": str(mx.default_device()), "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
