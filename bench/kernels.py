"""Forward+backward time and peak memory of each kernel tier against the naive path.

    python bench/kernels.py            # sizes that fit a CPU in a few minutes
    python bench/kernels.py --quick    # smaller, under a minute
    python bench/kernels.py --gpu      # a 1B model's shapes in bf16: N 4k-16k, V 32k-152k,
                                       # D 2048-4096; T 512-8192, head dim 64/128, causal, packed
    python bench/kernels.py --gpu --budget 150 --jsonl rows.jsonl   # stop starting cases at 150 s

linear_cross_entropy is compared with the naive form and with mlx-lm's loss (logits from the head,
then mlx.nn.losses.cross_entropy: the logsumexp over materialised logits, as mlx-lm's trainer
computes it); attention with the naive form (full [T, T] scores) and with MLX's fused attention
(``mx.fast.scaled_dot_product_attention``, "mlx"; packed rows give it a boolean mask). Each case
runs compiled value_and_grad with respect to every input (hidden and head; q, k and v), after one
warm-up, and reports the median of three runs. Ratios are tier / naive: under 1 is better. A
tier that fails (out of memory, say) gets a row with its error. Prints a table, then one JSON
line; ``--jsonl`` also writes each row as it comes.
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

from mlxtune.kernels import ATTENTION_IMPLS, IMPLS, attention, chunked, linear_cross_entropy
from mlxtune.kernels.flash import attention_native

# ce: (N tokens, V vocabulary, D hidden); attn: (B, Hq, Hkv, T, head dim, mode), mode "causal"
# or "packed" (causal within segments). The GPU sweep is ordered so that a --budget cut still
# leaves each kind of case measured at least once.
SWEEPS = {
    "quick": {"ce": [(1024, 8192, 64)], "attn": [(1, 4, 1, 512, 64, "causal")]},
    "cpu": {
        "ce": [(2048, 32768, 64), (2048, 32768, 256), (4096, 32768, 64)],
        "attn": [(1, 8, 2, t, 64, "causal") for t in (1024, 2048, 4096)]
        + [(1, 8, 2, 2048, 64, "packed")],
    },
    "gpu": {
        "ce": [
            (4096, 32768, 2048),
            (16384, 152064, 4096),
            (8192, 128256, 4096),
            (4096, 152064, 2048),
            (16384, 32768, 4096),
        ],
        "attn": [
            (1, 32, 8, 2048, 128, "causal"),
            (1, 32, 8, 8192, 128, "causal"),
            (1, 32, 8, 2048, 128, "packed"),
            (1, 32, 8, 8192, 128, "packed"),
            (1, 32, 8, 512, 64, "causal"),
            (1, 32, 8, 8192, 64, "causal"),
            (4, 32, 8, 512, 128, "causal"),
            (1, 32, 8, 4096, 64, "packed"),
        ],
    },
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
DEFAULT_CHUNK = chunked.CHUNK_ELEMENTS


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


def segments(b, t):
    """Packed rows: segments of 1/8 to 1/2 of the row, [B, T] int32."""
    ids = []
    for row in range(b):
        cuts, pos, i = [], 0, 0
        while pos < t:
            n = max(1, t // (2 + (row + i) % 7))
            cuts += [i] * min(n, t - pos)
            pos, i = pos + n, i + 1
        ids.append(cuts)
    return mx.array(ids, dtype=mx.int32)


def ce_cases(n, v, d, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    h = mx.random.normal((n, d), key=k1).astype(dtype)
    w = (mx.random.normal((v, d), key=k2) * d**-0.5).astype(dtype)
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


def ce_chunk_variants(size, dtype, sizes):
    """The chunked and GPU loss tiers at other chunk sizes, as "tier@elements": each sets
    chunked.CHUNK_ELEMENTS while it is traced (its first call)."""
    _, (h, w) = ce_cases(*size, dtype=dtype)
    t = mx.random.randint(0, size[1], (size[0],), key=mx.random.split(mx.random.key(0), 3)[2])
    out = {}
    for n in sizes:
        for impl in (i for i in IMPLS if i != "reference"):

            def f(h, w, impl=impl, n=n):
                chunked.CHUNK_ELEMENTS = n
                try:
                    return linear_cross_entropy(h, w, t, impl=impl)[0]
                finally:
                    chunked.CHUNK_ELEMENTS = DEFAULT_CHUNK

            out[f"{impl}@{n}"] = mx.compile(mx.value_and_grad(f, argnums=(0, 1)))
    return out


def attn_cases(b, hq, hkv, t, d, mode, dtype=mx.float32):
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    q = mx.random.normal((b, hq, t, d), key=k1).astype(dtype)
    k = mx.random.normal((b, hkv, t, d), key=k2).astype(dtype)
    v = mx.random.normal((b, hkv, t, d), key=k3).astype(dtype)
    seg = segments(b, t) if mode == "packed" else None
    mx.eval(q, k, v)
    fns = {
        impl: (
            lambda q, k, v, impl=impl: (
                attention(q, k, v, scale=d**-0.5, segment_ids=seg, impl=impl)
                .astype(mx.float32)
                .sum()
            )
        )
        for impl in ATTENTION_IMPLS
    }
    fns["mlx"] = lambda q, k, v: (
        attention_native(q, k, v, d**-0.5, True, seg).astype(mx.float32).sum()
    )
    return {name: mx.compile(mx.value_and_grad(f, argnums=(0, 1, 2))) for name, f in fns.items()}, (
        q,
        k,
        v,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), help="inputs' dtype (default: bfloat16 with --gpu)"
    )
    ap.add_argument("--budget", type=float, help="seconds after which no new case starts")
    ap.add_argument("--only", choices=["ce", "attn"], help="one operation's cases")
    ap.add_argument("--jsonl", help="also append each row to this file as it comes")
    ap.add_argument(
        "--memory-limit-gb",
        type=float,
        help="MLX's memory limit: MLX then holds back work that would go over it, so a chunked "
        "tier's peak is what it needs, not what a large GPU lets it run ahead with",
    )
    ap.add_argument(
        "--chunk-elements",
        type=int,
        nargs="*",
        default=[],
        help="also run the loss tiers at these chunk sizes (logits per chunk; the default is "
        f"{chunked.CHUNK_ELEMENTS})",
    )
    args = ap.parse_args(argv)
    sweep = SWEEPS["quick" if args.quick else "gpu" if args.gpu else "cpu"]
    dtype_name = args.dtype or ("bfloat16" if args.gpu else "float32")
    dtype = DTYPES[dtype_name]
    if args.memory_limit_gb:
        mx.set_memory_limit(int(args.memory_limit_gb * 1e9))
    rows, skipped, t_start = [], [], time.perf_counter()
    print(f"device {mx.default_device()}, {dtype_name}", file=sys.stderr)
    print(
        f"{'op':5} {'size':38} {'tier':16} {'time s':>8} {'peak MB':>9} {'time x':>7} "
        f"{'peak x':>7} {'first s':>8}",
        file=sys.stderr,
    )
    ops = [("ce", sweep["ce"], ce_cases), ("attn", sweep["attn"], attn_cases)]
    for op, sizes, make in ops:
        if args.only and op != args.only:
            continue
        for size in sizes:
            label = ("N=%d V=%d D=%d" if op == "ce" else "B=%d Hq=%d Hkv=%d T=%d D=%d %s") % size
            if args.budget is not None and time.perf_counter() - t_start > args.budget:
                skipped.append(f"{op} {label}")
                continue
            fns, inputs = make(*size, dtype=dtype)
            if op == "ce":
                fns.update(ce_chunk_variants(size, dtype, args.chunk_elements))
            naive_t = naive_m = None
            for name, fn in fns.items():  # "reference" first: the ratios' base
                row = {"op": op, "size": label, "tier": name, "dtype": dtype_name}
                try:
                    secs, peak, first = measure(fn, *inputs)
                except Exception as e:  # out of memory, a kernel that does not build
                    row["error"] = str(e).splitlines()[0][:200]
                    print(f"{op:5} {label:38} {name:16} failed: {row['error']}", file=sys.stderr)
                else:
                    if name == "reference":
                        naive_t, naive_m = secs, peak
                    row.update(
                        time_s=round(secs, 5),
                        peak_mb=round(peak, 1),
                        time_ratio=round(secs / naive_t, 3) if naive_t else None,
                        peak_ratio=round(peak / naive_m, 3) if naive_m else None,
                        first_call_s=round(first, 3),
                    )
                    print(
                        f"{op:5} {label:38} {name:16} {secs:8.4f} {peak:9.1f} "
                        f"{row['time_ratio'] or float('nan'):7.2f} "
                        f"{row['peak_ratio'] or float('nan'):7.2f} {first:8.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
                rows.append(row)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(row) + "\n")
            del fns, inputs
            mx.clear_cache()
    if skipped:
        print(f"not started (--budget {args.budget:g} s): {'; '.join(skipped)}", file=sys.stderr)
    out = {"device": str(mx.default_device()), "dtype": dtype_name, "rows": rows}
    print(json.dumps({**out, "skipped": skipped}))


if __name__ == "__main__":
    main()
