"""The GPU kernel tiers ("metal", "cuda"): one body per kernel, run here by the CPU emulator.

- each kernel alone against NumPy float64 (metal_kernels/numpy_ref.py, also the reference of
  bench/device/cuda_check.py);
- the whole tier (fused.py with the emulator as its launcher) against the naive MLX reference,
  values and gradients: the same code that runs on a GPU, but for the launcher;
- the emulator itself can fail: a divergent barrier and a missing barrier are caught;
- the CUDA twins compile with nvcc (where nvcc exists), within the shared-memory budget;
- ``pytest -m metal`` / ``pytest -m cuda`` run the real tiers (tests/test_kernel_gpu.py).
"""

import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from mlxtune import kernels
from mlxtune.kernels.flash import attention_reference
from mlxtune.kernels.fused import (
    EmulatedLauncher,
    make_attention,
    make_linear_cross_entropy,
    mlx_wins,
)
from mlxtune.kernels.reference import linear_cross_entropy_reference
from mlxtune.metal_kernels import (
    ATTN_DKV,
    ATTN_DQ,
    ATTN_FORWARD,
    KERNELS,
    LCE_BACKWARD,
    LCE_FORWARD,
    SHARED_FLOATS,
    Kernel,
    attention_block,
    cuda_standalone,
    emulate,
    numpy_ref,
    source,
)

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="needs a C++ compiler")

IGNORE = -100


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any()
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# ------------------------------------------------------------------- each kernel alone


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_lce_kernels_alone_match_numpy(softcap):
    rng = np.random.default_rng(1)
    n, c = 7, 300  # C is not a multiple of the group's 256 threads
    z = rng.normal(size=(n, c)).astype(np.float32) * 3
    tl = np.array([0, 299, -4, 300, 17, 150, 5], np.int32)  # two targets in other chunks
    st = np.stack(
        [rng.normal(size=n), rng.uniform(0.5, 2, n), rng.normal(size=n), rng.normal(size=n)], 1
    )
    st = st.astype(np.float32)
    prm = np.array([softcap or 1.0], np.float32)
    consts = {"TG": 256, "SOFTCAP": softcap is not None}
    (nst,), _ = emulate.run(LCE_FORWARD, [z, tl, st, prm], [(n, 4)], (n, 1), 256, consts)
    assert rel(nst, numpy_ref.lce_forward(z, tl, st, softcap)) < 1e-6

    lse = rng.normal(size=n).astype(np.float32) + 5
    g = rng.normal(size=n).astype(np.float32)
    prm = np.array([softcap or 1.0, 0.9, 0.1 / 1000], np.float32)
    (dz,), _ = emulate.run(LCE_BACKWARD, [z, tl, lse, g, prm], [(n, c)], (2, n), 256, consts)
    assert rel(dz, numpy_ref.lce_backward(z, tl, lse, g, softcap, 0.9, 0.1 / 1000)) < 1e-6


@pytest.mark.parametrize("dh", [8, 64])
@pytest.mark.parametrize("causal,segments", [(True, False), (False, True)])
def test_attention_kernels_alone_match_numpy(dh, causal, segments):
    rng = np.random.default_rng(dh)
    b, hq, hkv, t = 2, 4, 2, 21
    q, dout = (rng.normal(size=(b, hq, t, dh)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(b, hkv, t, dh)).astype(np.float32) for _ in range(2))
    seg = (np.arange(t)[None, :] // 8 + np.arange(b)[:, None]).astype(np.int32)
    prm = np.array([dh**-0.5], np.float32)
    ref_seg = seg if segments else None
    o_ref, lse_ref = numpy_ref.attn_forward(q, k, v, dh**-0.5, causal, ref_seg)

    def launch(kernel, inputs, outs, heads):
        bq = attention_block(dh, kernel)
        consts = {"DH": dh, "BQ": bq, "CAUSAL": causal, "HAS_SEG": segments}
        args = [*inputs, seg if segments else np.zeros(1, np.int32), prm]
        return emulate.run(kernel, args, outs, (-(-t // bq), heads), 4 * bq, consts, seed=dh)[0]

    o, lse = launch(ATTN_FORWARD, [q, k, v], [q.shape, (b, hq, t)], b * hq)
    assert rel(o, o_ref) < 1e-6 and rel(lse, lse_ref) < 1e-6
    dlt = (dout * o).sum(-1)
    refs = numpy_ref.attn_backward(q, k, v, dout, lse, dlt, dh**-0.5, causal, ref_seg)
    (dq,) = launch(ATTN_DQ, [q, k, v, dout, lse, dlt], [q.shape], b * hq)
    dk, dv = launch(ATTN_DKV, [q, k, v, dout, lse, dlt], [k.shape, v.shape], b * hkv)
    for got, want in zip((dq, dk, dv), refs, strict=True):
        assert rel(got, want) < 1e-5


# ------------------------------------------------------------------- the whole tier


def lce_inputs(n=37, d=16, v=300, dtype=mx.float32, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    h = mx.random.normal((n, d), key=k1).astype(dtype)
    w = (0.3 * mx.random.normal((v, d), key=k2)).astype(dtype)
    t = mx.random.randint(0, v, (n,), key=k3)
    return h, w, mx.where(mx.arange(n) % 7 == 0, IGNORE, t)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_lce_tier_matches_reference(label_smoothing, softcap):
    launcher = EmulatedLauncher(seed=3)
    tier = make_linear_cross_entropy(launcher)
    h, w, t = lce_inputs(seed=1)

    def ours(h, w):  # chunk 128: V=300 is three chunks, the last one 44 wide
        return tier(h, w, t, IGNORE, label_smoothing, softcap, chunk=128)[0].sum()

    def ref(h, w):
        return linear_cross_entropy_reference(h, w, t, IGNORE, label_smoothing, softcap)[0].sum()

    loss, (gh, gw) = mx.value_and_grad(ours, argnums=(0, 1))(h, w)
    want, (rh, rw) = mx.value_and_grad(ref, argnums=(0, 1))(h, w)
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert rel(gh, rh) < 1e-5 and rel(gw, rw) < 1e-5
    assert launcher.launches == {"lce_forward": 3, "lce_backward": 3}


def test_lce_tier_frozen_head_and_bf16():
    tier = make_linear_cross_entropy(EmulatedLauncher())
    h, w, t = lce_inputs(dtype=mx.bfloat16, seed=2)

    def ours(h, w):
        return tier(h, w, t, IGNORE, 0.0, None, chunk=256, weight_grad=False)[0].sum()

    def ref(h, w):
        return linear_cross_entropy_reference(h, w, t, IGNORE, 0.0, None)[0].sum()

    loss, (gh, gw) = mx.value_and_grad(ours, argnums=(0, 1))(h, w)
    want, (rh, _) = mx.value_and_grad(ref, argnums=(0, 1))(h, w)
    assert gh.dtype == mx.bfloat16
    assert abs(loss.item() - want.item()) <= 1e-2 * abs(want.item())
    assert rel(gh.astype(mx.float32), rh.astype(mx.float32)) < 1e-2
    assert not mx.any(gw).item()  # the frozen head's gradient is skipped


def qkv(b=2, hq=4, hkv=2, t=37, d=16, dtype=mx.float32, seed=0):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((b, hq, t, d), key=k1).astype(dtype)
    k = mx.random.normal((b, hkv, t, d), key=k2).astype(dtype)
    v = mx.random.normal((b, hkv, t, d), key=k3).astype(dtype)
    return q, k, v, mx.random.normal((b, hq, t, d), key=k4)


@pytest.mark.parametrize(
    "case",
    [
        dict(causal=True),
        dict(causal=False),
        dict(causal=True, segments=True),
        dict(causal=True, d=64, hq=2, hkv=1, b=1),  # tiles of 32 rows forward, 16 backward
        dict(causal=False, hq=3, hkv=3, t=5),  # no GQA, T below one tile
    ],
)
def test_attention_tier_matches_reference(case):
    case = dict(case)
    causal, segments = case.pop("causal"), case.pop("segments", False)
    q, k, v, ct = qkv(**case)
    b, t = q.shape[0], q.shape[2]
    seg = mx.array((np.arange(t)[None, :] // 10 + np.arange(b)[:, None]).astype(np.int32))
    seg = seg if segments else None
    scale = q.shape[-1] ** -0.5
    launcher = EmulatedLauncher(seed=5)
    tier = make_attention(launcher)

    def ours(q, k, v):
        return (tier(q, k, v, scale, causal, seg) * ct).sum()

    def ref(q, k, v):
        return (attention_reference(q, k, v, scale, causal, seg) * ct).sum()

    val, grads = mx.value_and_grad(ours, argnums=(0, 1, 2))(q, k, v)
    want, refs = mx.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    assert abs(val.item() - want.item()) <= 1e-5 * max(abs(want.item()), 1.0)
    for g, r in zip(grads, refs, strict=True):
        assert rel(g, r) < 1e-5
    assert launcher.launches == {"attn_forward": 1, "attn_dq": 1, "attn_dkv": 1}


def test_attention_tier_bf16_and_unsupported_head_size():
    launcher = EmulatedLauncher()
    tier = make_attention(launcher)
    q, k, v, ct = qkv(dtype=mx.bfloat16, t=20)
    out = tier(q, k, v, 0.25, True, None)
    ref = attention_reference(q, k, v, 0.25, True, None)
    assert out.dtype == mx.bfloat16
    assert rel(out.astype(mx.float32), ref.astype(mx.float32)) < 1e-2
    # a head size the kernels do not take runs the chunked tier instead, with the same result
    q, k, v, _ = qkv(d=6, t=9)
    launcher.launches.clear()
    out = tier(q, k, v, 0.4, True, None)
    assert launcher.launches == {}
    assert rel(out, attention_reference(q, k, v, 0.4, True, None)) < 1e-6


# ------------------------------------------------------------------- shapes MLX does better


def test_cuda_hands_the_measured_attention_shapes_to_mlx():
    """On CUDA, 16-bit attention without segments, head dim a multiple of 8 up to 128 and T a
    multiple of 128 runs MLX's fused attention (the kernels launch nothing); any other shape
    runs the kernels. Both agree with the reference."""
    launcher = EmulatedLauncher(backend="cuda")
    tier = make_attention(launcher)

    def check(q, k, v, seg, launched, tol):
        launcher.launches.clear()
        out = tier(q, k, v, 0.3, True, seg).astype(mx.float32)
        ref = attention_reference(q, k, v, 0.3, True, seg).astype(mx.float32)
        assert rel(out, ref) < tol
        assert bool(launcher.launches) == launched

    q, k, v, _ = qkv(b=1, hq=4, hkv=2, t=128, d=64, dtype=mx.bfloat16)
    check(q, k, v, None, False, 1e-2)
    seg = mx.array((np.arange(128)[None, :] // 50).astype(np.int32))
    check(q, k, v, seg, True, 1e-2)  # packed rows: not measured, the kernels
    check(*qkv(b=1, hq=4, hkv=2, t=120, d=64, dtype=mx.bfloat16)[:3], None, True, 1e-2)
    check(*qkv(b=1, hq=4, hkv=2, t=128, d=136, dtype=mx.bfloat16)[:3], None, True, 1e-2)
    check(*qkv(b=1, hq=4, hkv=2, t=128, d=60, dtype=mx.bfloat16)[:3], None, True, 1e-2)
    check(*qkv(b=1, hq=4, hkv=2, t=128, d=64)[:3], None, True, 1e-5)  # fp32: the kernels
    # the gradient of the handed-over shape is MLX's, and right
    ct = mx.random.normal((1, 4, 128, 64), key=mx.random.key(9))

    def f(tier_fn):
        return lambda q, k, v: (tier_fn(q, k, v, 0.3, True, None).astype(mx.float32) * ct).sum()

    _, got = mx.value_and_grad(f(tier), argnums=(0, 1, 2))(q, k, v)
    _, want = mx.value_and_grad(f(attention_reference), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert rel(a.astype(mx.float32), b.astype(mx.float32)) < 2e-2
    # another backend keeps the kernels for the same shape
    other = EmulatedLauncher()
    make_attention(other)(q, k, v, 0.3, True, None)
    assert other.launches


def test_cuda_builds_the_logits_while_they_stay_small():
    """On CUDA the loss builds the logits while N x V is at most 2**28, else runs the kernels."""
    launcher = EmulatedLauncher(backend="cuda")
    tier = make_linear_cross_entropy(launcher)
    h, w, t = lce_inputs(n=37, d=16, v=300, seed=4)

    def ours(h, w):
        return tier(h, w, t, IGNORE, 0.1, 4.0)[0].sum()

    def ref(h, w):
        return linear_cross_entropy_reference(h, w, t, IGNORE, 0.1, 4.0)[0].sum()

    loss, (gh, gw) = mx.value_and_grad(ours, argnums=(0, 1))(h, w)
    want, (rh, rw) = mx.value_and_grad(ref, argnums=(0, 1))(h, w)
    assert launcher.launches == {}
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    assert rel(gh, rh) < 1e-6 and rel(gw, rw) < 1e-6
    tier(h, w, t, IGNORE, 0.0, None, chunk=128)  # an explicit chunk runs the kernels
    assert launcher.launches == {"lce_forward": 3}
    assert mlx_wins("cuda", "linear_cross_entropy", 4096, 65536)  # 2**28: still built
    assert not mlx_wins("cuda", "linear_cross_entropy", 4096, 65537)
    assert not mlx_wins("metal", "linear_cross_entropy", 16, 16)  # not measured there


# ------------------------------------------------------------------- the emulator can fail

DIVERGENT = Kernel(
    "divergent",
    ("x",),
    ("y",),
    text="""
  if (ktid == 3) { return; }
  KBARRIER();
  y[ktid] = x[ktid];
""",
)

# reverses x within the group, but reads shared memory without the barrier that publishes it
UNSYNCED = Kernel(
    "unsynced",
    ("x",),
    ("y",),
    text="""
  KSHARED float buf[64];
  buf[ktid] = x[ktid];
  y[ktid] = buf[63 - ktid];
""",
)


def test_emulator_reports_a_divergent_barrier():
    with pytest.raises(emulate.EmulationError, match="divergent"):
        emulate.run(DIVERGENT, [np.ones(64, np.float32)], [(64,)], (1, 1), 64, {})


def test_emulator_catches_a_missing_barrier():
    x = np.arange(64, dtype=np.float32) + 1
    (y,), _ = emulate.run(UNSYNCED, [x], [(64,)], (1, 1), 64, {}, seed=1)
    assert not np.array_equal(y, x[::-1])
    synced = Kernel(
        "synced", ("x",), ("y",), text=UNSYNCED.text.replace("  y[", "  KBARRIER();\n  y[")
    )
    for seed in range(3):
        (y,), _ = emulate.run(synced, [x], [(64,)], (1, 1), 64, {}, seed=seed)
        np.testing.assert_array_equal(y, x[::-1])


# ------------------------------------------------------------------- the backends' sources


def test_metal_sources_use_only_metal():
    for kernel in KERNELS:
        text = source(kernel, "metal")
        for word in ("__syncthreads", "__shared__", "threadIdx", "blockIdx", "static ", "std::"):
            assert word not in text, (kernel.name, word)
        # MLX declares a thread attribute only when its name appears in the source
        for attr in ("thread_index_in_threadgroup", "threadgroup_position_in_grid"):
            assert attr in text


def test_attention_tiles_fit_threadgroup_memory():
    for dh in (8, 16, 64, 80, 96, 128, 256):
        for kernel, (a, s) in ((ATTN_FORWARD, (3, 1)), (ATTN_DQ, (4, 1)), (ATTN_DKV, (4, 2))):
            bq = attention_block(dh, kernel)
            assert bq is not None and bq >= 4
            assert a * bq * dh + s * bq * bq <= SHARED_FLOATS
    assert attention_block(6, ATTN_FORWARD) is None
    assert attention_block(512, ATTN_DQ) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_twins_compile(tmp_path):
    launches = []
    for dt in ("float32", "bfloat16", "float16"):
        launches.append((LCE_FORWARD, {"z": dt, "tl": "int32"}, {"TG": 256, "SOFTCAP": True}))
        launches.append((LCE_BACKWARD, {"z": dt, "tl": "int32"}, {"TG": 256, "SOFTCAP": True}))
        for dh in (64, 128) if dt != "float16" else (96,):
            types = {"q": dt, "k": dt, "v": dt, "dout": dt, "seg": "int32"}
            for kernel in (ATTN_FORWARD, ATTN_DQ, ATTN_DKV):
                consts = {
                    "DH": dh,
                    "BQ": attention_block(dh, kernel),
                    "CAUSAL": True,
                    "HAS_SEG": dt == "float32",
                }
                launches.append((kernel, types, consts))
    src = tmp_path / "kernels.cu"
    src.write_text(cuda_standalone(launches))
    cmd = ["nvcc", "-arch=sm_90", "-c", "-Xptxas", "-v", "-o", str(tmp_path / "k.o"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", done.stderr)]
    assert len(re.findall(r"Compiling entry function", done.stderr)) == len(launches)
    assert smem and max(smem) <= 4 * SHARED_FLOATS + 1024
    assert "spill stores" in done.stderr and not re.search(
        r"[1-9]\d* bytes spill stores", done.stderr
    )


# ------------------------------------------------------------------- choosing a GPU tier


def test_auto_uses_a_gpu_tier_only_once_it_passes_its_self_check(monkeypatch):
    from mlxtune.kernels.chunked import linear_cross_entropy_chunked

    launcher = EmulatedLauncher()
    monkeypatch.setattr(kernels, "_SELF_CHECKS", {})
    monkeypatch.setitem(kernels.IMPLS, "good", make_linear_cross_entropy(launcher))
    monkeypatch.setitem(kernels.ATTENTION_IMPLS, "good", make_attention(launcher))

    def wrong(*args, **kw):  # a tier whose loss is off by 1%
        losses, valid = linear_cross_entropy_chunked(*args, **kw)
        return losses * 1.01, valid

    monkeypatch.setitem(kernels.IMPLS, "bad", wrong)
    monkeypatch.setitem(kernels.ATTENTION_IMPLS, "bad", kernels.ATTENTION_IMPLS["chunked"])
    assert kernels.self_check("good") is None
    assert "linear_cross_entropy differs" in kernels.self_check("bad")
    assert launcher.launches["lce_forward"] >= 1 and launcher.launches["attn_dkv"] == 1

    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "_GPU", "good")
    assert kernels.best_impl() == "good"
    monkeypatch.setattr(kernels, "_GPU", "bad")
    assert kernels.best_impl() == "chunked"
    monkeypatch.setattr(kernels, "on_gpu", lambda: False)
    monkeypatch.setattr(kernels, "_GPU", "good")
    assert kernels.best_impl() == "chunked"  # the default device is the CPU


def test_the_trainer_checks_a_gpu_tier_only_when_the_recipe_could_use_it(
    monkeypatch, tmp_path, data_dir, llama_dir
):
    from conftest import tiny_recipe
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    checked = []
    monkeypatch.delenv("MLXTUNE_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "check_impl", lambda impl, impls=None: None)
    monkeypatch.setattr(kernels, "self_check", lambda tier: checked.append(tier))
    for name, chosen in (("fixed", "chunked"), ("auto", "auto")):
        # the fixed choice alone: measuring (kernels.autotune) checks each tier it times
        k = {"loss": chosen, "attention": chosen, "autotune": False}
        Trainer(
            recipe_from_dict(tiny_recipe(data_dir, llama_dir, kernels=k)),
            tmp_path / name,
            console=Console(quiet=True),
        )
        assert checked == ([] if name == "fixed" else ["metal"]), name
