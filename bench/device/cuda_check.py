"""Run the CUDA twins of mlxtune's kernels on an NVIDIA GPU under CuPy, without MLX, and check
each against NumPy float64 (metal_kernels/numpy_ref.py, the same references the CPU emulator is
tested against).

    pip install cupy-cuda13x numpy      # on the GPU machine
    python bench/device/cuda_check.py [--time]

Prints one line per check (kernel, dtype, sizes, relative error) and exits 1 if any fails:
fp32 must land under 1e-5, bf16 operands under 1e-2, and a NaN never passes. ``--time`` adds
the median time of each kernel over 20 runs at a larger size, timed with CUDA events.

Seen on an H100 (CUDA 13, CuPy 13): every check passes, fp32 and bf16 operands alike within
2e-6 of the float64 references. See bench/device/README.md for the timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupy as cp  # noqa: E402

import metal_kernels as mk  # noqa: E402  (the folder itself: no MLX needed)
from metal_kernels import numpy_ref  # noqa: E402


def bf16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the uint16 bit patterns of x rounded to bf16, their float32 values)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded, (rounded.astype(np.uint32) << 16).view(np.float32)


class Runner:
    def __init__(self, launches):
        self.module = cp.RawModule(code=mk.cuda_standalone(launches), options=("-std=c++17",))

    def __call__(self, kernel, dtypes, consts, inputs, outputs, groups, threads):
        fn = self.module.get_function(mk.cuda_name(kernel, dtypes, consts))
        shaped = set(kernel.shape_inputs())
        args = []
        for name, a in zip(kernel.inputs, inputs, strict=True):
            args.append(cp.asarray(a))
            if name in shaped:
                shape = np.zeros(8, np.int32)
                shape[: len(a.shape)] = a.shape
                args.append(cp.asarray(shape))
        outs = [cp.full(s, cp.nan, dtype=cp.float32) for s in outputs]
        fn(tuple(groups), (threads,), tuple(args + outs))
        cp.cuda.Device().synchronize()
        return [cp.asnumpy(o) for o in outs], (fn, tuple(groups), (threads,), tuple(args + outs))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.isnan(a).any():
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def time_launch(call, reps=20):
    fn, grid, block, args = call
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps + 3):
        start.record()
        fn(grid, block, args)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times[3:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    failures = 0

    def report(what, err, tol):
        nonlocal failures
        ok = err == err and err < tol
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what:60} rel err {err:.2e} (tol {tol:.0e})")

    sizes = [(256, 1000, 64, 333), (64, 96, 128, 200)]  # N, C, D(head), T
    if args.time:
        sizes.append((4096, 8192, 128, 4096))
    for dt, tol in (("float32", 1e-5), ("bfloat16", 1e-2)):

        def cast(x, dt=dt):
            if dt == "float32":
                return np.ascontiguousarray(x, np.float32), np.asarray(x, np.float32)
            return bf16(x)

        for n, c, dh, t in sizes:
            big = args.time and n == 4096
            # ---- cross-entropy kernels
            z_dev, z = cast(rng.normal(size=(n, c)) * 3)
            tl = rng.integers(-c // 2, c + c // 2, n).astype(np.int32)
            st = np.stack(
                [
                    rng.normal(size=n),
                    rng.uniform(0.5, 2, n),
                    rng.normal(size=n),
                    rng.normal(size=n),
                ],
                1,
            ).astype(np.float32)
            for cap in (None, 4.0):
                consts = {"TG": 256, "SOFTCAP": cap is not None}
                types = {"z": dt, "tl": "int32"}
                run = Runner([(mk.LCE_FORWARD, types, consts), (mk.LCE_BACKWARD, types, consts)])
                prm = np.array([cap or 1.0], np.float32)
                (nst,), call = run(
                    mk.LCE_FORWARD, types, consts, [z_dev, tl, st, prm], [(n, 4)], (n, 1), 256
                )
                report(
                    f"lce_forward {dt} N={n} C={c} cap={cap}",
                    rel(nst, numpy_ref.lce_forward(z, tl, st, cap)),
                    tol,
                )
                if big:
                    print(f"     time {time_launch(call):.3f} ms")
                lse = rng.normal(size=n).astype(np.float32) + 5
                g = rng.normal(size=n).astype(np.float32)
                prm = np.array([cap or 1.0, 0.9, 0.1 / c], np.float32)
                (dz,), call = run(
                    mk.LCE_BACKWARD,
                    types,
                    consts,
                    [z_dev, tl, lse, g, prm],
                    [(n, c)],
                    (-(-c // 256), n),
                    256,
                )
                want = numpy_ref.lce_backward(z, tl, lse, g, cap, 0.9, 0.1 / c)
                report(f"lce_backward {dt} N={n} C={c} cap={cap}", rel(dz, want), tol)
                if big:
                    print(f"     time {time_launch(call):.3f} ms")
            # ---- attention kernels
            b, hq, hkv = 2, 4, 2
            (q_dev, q), (do_dev, do) = (
                cast(rng.normal(size=(b, hq, t, dh))),
                cast(rng.normal(size=(b, hq, t, dh))),
            )
            (k_dev, k), (v_dev, v) = (
                cast(rng.normal(size=(b, hkv, t, dh))),
                cast(rng.normal(size=(b, hkv, t, dh))),
            )
            seg = (np.arange(t)[None, :] // 100 + np.arange(b)[:, None]).astype(np.int32)
            for causal, has_seg in ((True, False), (False, True), (True, True)):
                types = {"q": dt, "k": dt, "v": dt, "dout": dt, "seg": "int32"}
                launches = []
                for kern in (mk.ATTN_FORWARD, mk.ATTN_DQ, mk.ATTN_DKV):
                    consts = {
                        "DH": dh,
                        "BQ": mk.attention_block(dh, kern),
                        "CAUSAL": causal,
                        "HAS_SEG": has_seg,
                    }
                    launches.append((kern, types, consts))
                run = Runner(launches)
                prm = np.array([dh**-0.5], np.float32)
                s_dev = seg if has_seg else np.zeros(1, np.int32)
                rseg = seg if has_seg else None
                outs = {}
                for kern, _, consts in launches:
                    bq = consts["BQ"]
                    heads = b * (hkv if kern is mk.ATTN_DKV else hq)
                    if kern is mk.ATTN_FORWARD:
                        ins, shapes = [q_dev, k_dev, v_dev, s_dev, prm], [q.shape, (b, hq, t)]
                    else:
                        o, lse = outs["attn_forward"]
                        dlt = (do * o).sum(-1).astype(np.float32)
                        ins = [q_dev, k_dev, v_dev, do_dev, lse, dlt, s_dev, prm]
                        shapes = [q.shape] if kern is mk.ATTN_DQ else [k.shape, v.shape]
                    got, call = run(kern, types, consts, ins, shapes, (-(-t // bq), heads), 4 * bq)
                    outs[kern.name] = got
                    if big:
                        print(f"     {kern.name} time {time_launch(call):.3f} ms")
                o_ref, lse_ref = numpy_ref.attn_forward(q, k, v, dh**-0.5, causal, rseg)
                what = f"{dt} T={t} DH={dh} causal={causal} seg={has_seg}"
                report(
                    f"attn_forward {what}",
                    max(rel(outs["attn_forward"][0], o_ref), rel(outs["attn_forward"][1], lse_ref)),
                    tol,
                )
                o, lse = outs["attn_forward"]
                refs = numpy_ref.attn_backward(
                    q, k, v, do, lse, (do * o).sum(-1), dh**-0.5, causal, rseg
                )
                report(f"attn_dq {what}", rel(outs["attn_dq"][0], refs[0]), tol)
                report(
                    f"attn_dkv {what}",
                    max(rel(outs["attn_dkv"][0], refs[1]), rel(outs["attn_dkv"][1], refs[2])),
                    tol,
                )
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
