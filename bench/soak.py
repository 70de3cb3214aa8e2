"""A soak: a long run of recipes/quickstart-lora.yaml, with its memory sampled as it goes.

    python bench/soak.py                  # 20,000 steps, a checkpoint every 100, the last 3 kept
    python bench/soak.py --steps 2000     # a quicker look

Every ``--sample-every`` steps a callback records the process's resident memory (RSS) and MLX's
active and cache memory. At the end it reports how each grew from step 1,000 (the run warmed up:
compiled, the optimizer's state allocated, the allocator's cache filled) to the last step, and
what the run directory holds: the step checkpoints ``keep_last`` allows, best and final, and no
staging folder left behind. Evaluation and samples run every 1,000 steps, so generation and the
evaluation step are soaked too. The target: each grows by under 5%. Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rss_bytes() -> int:
    """This process's resident memory now (not its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # macOS: ps reports KB
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True)
        return int(out.stdout.strip() or 0) * 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--every", type=int, default=100, help="checkpoint every N steps")
    ap.add_argument("--keep", type=int, default=3, help="checkpoints.keep_last")
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--from-step", type=int, default=1000, help="growth measured from here")
    args = ap.parse_args(argv)

    import mlxtune  # first: it puts OpenBLAS under MLX's CPU backend before MLX loads
    from mlxtune.console import Console

    samples: list[dict] = []
    import mlx.core as mx

    class Sample(mlxtune.Callback):
        def on_step(self, trainer, event):
            if event.step % args.sample_every == 0 or event.step == args.steps:
                samples.append(
                    {
                        "step": event.step,
                        "rss_mb": rss_bytes() / 1e6,
                        "active_mb": mx.get_active_memory() / 1e6,
                        "cache_mb": mx.get_cache_memory() / 1e6,
                    }
                )

    overrides = [
        f"train.max_steps={args.steps}",
        "train.log_every=100",
        f"checkpoints.every={args.every}",
        f"checkpoints.keep_last={args.keep}",
        "eval.every=1000",
        "eval.exact_match=0",
        "samples.every=1000",
    ]
    recipe = mlxtune.load_recipe(REPO / "recipes" / "quickstart-lora.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        start = time.perf_counter()
        trainer = mlxtune.Trainer(recipe, run_dir=run, console=Console(quiet=True),
                                  callbacks=[Sample()])  # fmt: skip
        summary = trainer.run()
        took = time.perf_counter() - start
        held = sorted(p.name for p in (run / "checkpoints").iterdir())
        stray = [str(p.relative_to(run)) for p in run.rglob("*.tmp")]
        stray += [str(p.relative_to(run)) for p in run.rglob(".*.old")]
    first = next(s for s in samples if s["step"] >= min(args.from_step, args.steps))
    last = samples[-1]
    growth = {k: last[k] / first[k] - 1 for k in ("rss_mb", "active_mb") if first[k]}
    want = {"best", "final", *(f"step-{s:06d}" for s in _kept(args))}
    print(f"{summary['steps']:,} steps in {took / 60:.1f} min; checkpoints held: {held}",
          file=sys.stderr)  # fmt: skip
    print(f"{'step':>7} {'RSS MB':>9} {'active MB':>10} {'cache MB':>9}", file=sys.stderr)
    shown = samples[:: max(1, len(samples) // 20)] + [last]
    for s in shown:
        print(f"{s['step']:>7} {s['rss_mb']:>9.1f} {s['active_mb']:>10.1f} {s['cache_mb']:>9.1f}",
              file=sys.stderr)  # fmt: skip
    for k, v in growth.items():
        print(f"growth of {k} from step {first['step']} to {last['step']}: {v:+.2%}",
              file=sys.stderr)  # fmt: skip
    print(f"run directory as keep_last allows: {set(held) == want}; left behind: {stray or 'none'}",
          file=sys.stderr)  # fmt: skip
    print(
        json.dumps(
            {
                "steps": summary["steps"],
                "minutes": round(took / 60, 2),
                "from_step": first["step"],
                "growth": {k: round(v, 4) for k, v in growth.items()},
                "first": first,
                "last": last,
                "checkpoints": held,
                "as_keep_last_allows": set(held) == want,
                "left_behind": stray,
            }
        )
    )


def _kept(args) -> list[int]:
    """The step checkpoints keep_last leaves at the end."""
    saved = list(range(args.every, args.steps + 1, args.every))
    return saved[-args.keep :]


if __name__ == "__main__":
    main()
