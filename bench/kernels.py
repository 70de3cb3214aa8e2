"""Forward+backward time and peak memory of each kernel tier against the naive path.

    python bench/kernels.py            # sizes that fit a CPU in a few minutes
    python bench/kernels.py --quick    # smaller, under a minute
    python bench/kernels.py --gpu      # the issue's sweep: N 2k-16k, V 32k-152k, D up to 4096, T 1k-8k

linear_cross_entropy is compared with the naive form and with mlx-lm's loss (logits from the head,
then mlx.nn.losses.cross_entropy, as mlx-lm's trainer computes it); attention with the naive form
(full [T, T] scores). Each case runs compiled value_and_grad with respect to every input (hidden
and head; q, k and v), after one warm-up, and reports the median of three runs. Ratios are
tier / naive: under 1 is better. Prints a table, then one JSON line.
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
import mlx.nn as nn

from mlxtune.kernels import ATTENTION_IMPLS, IMPLS, attention, linear_cross_entropy

SWEEPS = {
    "quick": {"ce": [(1024, 8192, 64)], "attn": [(1, 4, 1, 512, 64)]},
    "cpu": {
        "ce": [(2048, 32768, 64), (2048, 32768, 256), (4096, 32768, 64)],
        "attn": [(1, 8, 2, 1024, 64), (1, 8, 2, 2048, 64), (1, 8, 2, 4096, 64)],
    },
    "gpu": {
        "ce": [
            (n, v, d)
            for n in (2048, 8192, 16384)
            for v in (32768, 152064)
            for d in (64, 1024, 4096)
        ],
        "attn": [(1, 32, 8, t, 128) for t in (1024, 2048, 4096, 8192)],
    },
}


def measure(fn, *args, reps=3):
    """(median seconds, peak MB above the inputs, seconds of the first call) of a compiled
    function; the first call (tracing, and on a GPU the kernels' JIT builds) is not in the
    median."""
    t0 = time.perf_counter()
    mx.eval(fn(*args))
    mx.synchronize()
    first = time.perf_counter() - t0
    times = []
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (mx.get_peak_memory() - base) / 1e6, first


def ce_cases(n, v, d):
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    h = mx.random.normal((n, d), key=k1)
    w = mx.random.normal((v, d), key=k2) * d**-0.5
    t = mx.random.randint(0, v, (n,), key=k3)
    mx.eval(h, w, t)

    def tier(impl):
        return lambda h, w: linear_cross_entropy(h, w, t, impl=impl)[0]

    def mlx_lm_loss(h, w):
        return nn.losses.cross_entropy(h @ w.T, t, reduction="sum")

    fns = {**{impl: tier(impl) for impl in IMPLS}, "mlx-lm": mlx_lm_loss}
    return {name: mx.compile(mx.value_and_grad(f, argnums=(0, 1))) for name, f in fns.items()}, (
        h,
        w,
    )


def attn_cases(b, hq, hkv, t, d):
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    q = mx.random.normal((b, hq, t, d), key=k1)
    k = mx.random.normal((b, hkv, t, d), key=k2)
    v = mx.random.normal((b, hkv, t, d), key=k3)
    mx.eval(q, k, v)
    fns = {
        impl: (lambda q, k, v, impl=impl: attention(q, k, v, scale=d**-0.5, impl=impl).sum())
        for impl in ATTENTION_IMPLS
    }
    return {name: mx.compile(mx.value_and_grad(f, argnums=(0, 1, 2))) for name, f in fns.items()}, (
        q,
        k,
        v,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args(argv)
    sweep = SWEEPS["quick" if args.quick else "gpu" if args.gpu else "cpu"]
    rows = []
    print(f"device {mx.default_device()}", file=sys.stderr)
    print(
        f"{'op':5} {'size':28} {'tier':10} {'time s':>8} {'peak MB':>9} {'time x':>7} "
        f"{'peak x':>7} {'first s':>8}",
        file=sys.stderr,
    )
    for op, sizes, make in (("ce", sweep["ce"], ce_cases), ("attn", sweep["attn"], attn_cases)):
        for size in sizes:
            fns, inputs = make(*size)
            label = ("N=%d V=%d D=%d" if op == "ce" else "B=%d Hq=%d Hkv=%d T=%d D=%d") % size
            naive_t = naive_m = None
            for name, fn in fns.items():  # "reference" first: the ratios' base
                secs, peak, first = measure(fn, *inputs)
                if name == "reference":
                    naive_t, naive_m = secs, peak
                row = {
                    "op": op,
                    "size": label,
                    "tier": name,
                    "time_s": round(secs, 4),
                    "peak_mb": round(peak, 1),
                    "time_ratio": round(secs / naive_t, 3),
                    "peak_ratio": round(peak / naive_m, 3),
                    "first_call_s": round(first, 3),
                }
                rows.append(row)
                print(
                    f"{op:5} {label:28} {name:10} {secs:8.3f} {peak:9.1f} {row['time_ratio']:7.2f} "
                    f"{row['peak_ratio']:7.2f} {first:8.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    print(json.dumps({"device": str(mx.default_device()), "rows": rows}))


if __name__ == "__main__":
    main()
