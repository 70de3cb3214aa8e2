"""The gated delta rule, forward and backward: mlxtune's chunkwise form against mlx-lm's loop
(``gated_delta_ops``, what mlx-lm trains by), in one process; with --ssd, Mamba-2's SSD:
mlxtune's ``ssd_update`` against mlx-lm's ``ssm_attn`` (chunked by 256 positions).

    python bench/gated_delta.py                       # T 256-2048, 8 heads of 128 x 128
    python bench/gated_delta.py --lengths 1024 4096 --vector
    python bench/gated_delta.py --ssd --lengths 1024 4096 16384   # 32 heads of 64 x 128, 8 groups

Each case runs compiled value_and_grad with respect to q, k, v, the gates and beta (a row of T
positions, Hv value heads and Hk key heads of Dk x Dv, scalar gates or one per key dimension),
after one warm-up, the median of three runs; MLX's peak memory is taken around one run. Ratios
are mlx-lm / mlxtune: over 1, mlxtune is faster or leaner. mlx-lm's loop is left out past
--loop-max tokens (its graph grows with T). Prints a line a length, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlxtune  # noqa: F401  (first: picks up OpenBLAS before mlx loads)

# isort: split

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_ops
from mlx_lm.models.ssm import ssm_attn

from mlxtune.kernels.delta import chunked_gated_delta, ssd_update


def inputs(t: int, hk: int, hv: int, d: int, vector: bool):
    keys = mx.random.split(mx.random.key(0), 5)
    q = mx.random.normal((1, t, hk, d), key=keys[0])
    k = mx.random.normal((1, t, hk, d), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, t, hv, d), key=keys[2])
    shape = (1, t, hv, d) if vector else (1, t, hv)
    log_g = -mx.random.uniform(0.001, 0.2, shape, key=keys[3])
    beta = mx.random.uniform(0.1, 1.0, (1, t, hv), key=keys[4])
    return q, k, v, log_g, beta


def ssd_inputs(t: int, heads: int, head_dim: int, state: int, groups: int):
    """x, A_log, B, C, D, dt, dt_bias of a Mamba-2 layer (Nemotron-H's shape at fewer heads)."""
    keys = mx.random.split(mx.random.key(1), 5)
    x = mx.random.normal((1, t, heads, head_dim), key=keys[0])
    B = mx.random.normal((1, t, groups, state), key=keys[1]) * state**-0.5
    C = mx.random.normal((1, t, groups, state), key=keys[2]) * state**-0.5
    dt = mx.random.normal((1, t, heads), key=keys[3]) - 2.0
    A_log = mx.log(mx.arange(1, heads + 1, dtype=mx.float32))
    return x, A_log, B, C, mx.ones(heads), dt, mx.zeros(heads)


def case(fn, args) -> dict:
    """Seconds (median of three, after a warm-up) and peak GB of fn's value and gradients."""

    def loss(*a):
        y, s = fn(*a)
        return y.sum() + s.sum()

    step = mx.compile(mx.value_and_grad(loss, argnums=tuple(range(len(args)))))
    mx.eval(step(*args))
    mx.clear_cache()
    mx.reset_peak_memory()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval(step(*args))
        times.append(time.perf_counter() - t0)
    peak = mx.get_peak_memory() / 1e9
    del step
    mx.clear_cache()
    return {"s": round(statistics.median(times), 4), "peak_gb": round(peak, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--heads", type=int, default=8, help="value heads (key heads: half)")
    ap.add_argument("--dim", type=int, default=128, help="Dk = Dv")
    ap.add_argument("--vector", action="store_true", help="a gate per key dimension")
    ap.add_argument("--loop-max", type=int, default=2048, help="longest T mlx-lm's loop runs")
    ap.add_argument("--ssd", action="store_true", help="Mamba-2's SSD (32 heads of 64 x 128)")
    args = ap.parse_args(argv)
    rows = []
    for t in args.lengths:
        if args.ssd:
            a = ssd_inputs(t, 32, 64, 128, 8)
            ours = case(ssd_update, a)
        else:
            a = inputs(t, max(args.heads // 2, 1), args.heads, args.dim, args.vector)
            ours = case(chunked_gated_delta, a)
        row = {"T": t, "mlxtune": ours}
        if t <= args.loop_max:

            def theirs(q, k, v, log_g, beta):
                return gated_delta_ops(q, k, v, mx.exp(log_g), beta)

            row["mlx-lm"] = case(ssm_attn if args.ssd else theirs, a)
            row["speed"] = round(row["mlx-lm"]["s"] / ours["s"], 2)
            row["memory"] = round(row["mlx-lm"]["peak_gb"] / max(ours["peak_gb"], 1e-9), 2)
        rows.append(row)
        line = f"T={t}: mlxtune {ours['s']:.3f} s, {ours['peak_gb']:.3f} GB"
        if "mlx-lm" in row:
            line += (
                f"; mlx-lm {row['mlx-lm']['s']:.3f} s, {row['mlx-lm']['peak_gb']:.3f} GB; "
                f"{row['speed']}x faster, {row['memory']}x less memory"
            )
        print(line, file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "op": ("Mamba-2 SSD" if args.ssd else "gated delta rule") + ", value and gradients",
                "heads": 32 if args.ssd else args.heads,
                "dim": "64 x 128, 8 groups" if args.ssd else args.dim,
                "vector_gates": args.vector,
                "device": str(mx.default_device()),
                "mlx": mx.__version__,
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
