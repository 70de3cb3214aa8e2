"""Fused training kernels, behind fixed entry points.

``linear_cross_entropy(hidden, weight, targets, ...)`` is the LM head and the cross-entropy in
one call; ``attention(q, k, v, ...)`` is scaled dot-product attention. Each tier computes the
same thing: "reference" is the naive MLX form (it builds the [N, V] logits, the [T, T] scores),
the tier every other one is tested against; "chunked" is portable MLX that never builds them
(chunked.py, flash.py; attention hands rows with small scores to MLX's fused attention); "metal" and "cuda" run the same blocks as GPU kernels written once for
both backends (fused.py, mlxtune.metal_kernels), and exist where that GPU backend does.
Attention has one more, "native": MLX's own fused attention, a boolean mask keeping packed
sequences apart. ``impl`` may also be a ``tune.Tuned``: the tier measured fastest for each
shape (tune.py). ``linear_entropy(hidden, weight)``, the entropy of the head's distributions
(forward only, for GRPO's entropy mask), has one portable form, chunked like the loss.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .chunked import (
    QuantizedRows,
    dense,
    forward_only,
    linear_cross_entropy_chunked,
    linear_entropy_chunked,
)
from .flash import attention_chunked, attention_native, attention_reference
from .fused import FastLauncher, make_attention, make_linear_cross_entropy
from .reference import linear_cross_entropy_reference

# Every tier there is; IMPLS and ATTENTION_IMPLS hold those that run on this machine.
TIERS = ("reference", "chunked", "native", "metal", "cuda")

IMPLS = {"reference": linear_cross_entropy_reference, "chunked": linear_cross_entropy_chunked}
ATTENTION_IMPLS = {
    "reference": attention_reference,
    "chunked": attention_chunked,
    "native": attention_native,
}


def gpu_backend() -> str | None:
    """ "metal" or "cuda" where MLX has that GPU backend here, else None."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


_GPU = gpu_backend()
if _GPU is not None:
    _launcher = FastLauncher(_GPU)
    IMPLS[_GPU] = make_linear_cross_entropy(_launcher)
    ATTENTION_IMPLS[_GPU] = make_attention(_launcher)


def available_impls() -> list[str]:
    """Tiers of linear_cross_entropy (and of attention) that run on this machine."""
    return list(IMPLS)


def on_gpu() -> bool:
    """Whether MLX's default device is a GPU."""
    return mx.default_device().type == mx.DeviceType.gpu


# tier -> None when it agreed with the reference on this machine, else why not
_SELF_CHECKS: dict[str, str | None] = {}


def self_check(tier: str) -> str | None:
    """Run ``tier`` once per process on small inputs, values and gradients of both operations,
    against the reference: None when it agrees, else what went wrong (a kernel that does not
    compile on this GPU, or wrong numbers). ``impl=None`` uses a GPU tier only once it passes.
    Call it (or ``best_impl()``) before ``mx.compile`` traces a function that uses the kernels:
    it evaluates arrays, which a trace does not allow."""
    if tier in _SELF_CHECKS:
        return _SELF_CHECKS[tier]
    try:
        why = _compare_with_reference(tier)
    except Exception as e:  # a kernel that fails to build or run on this device
        if "transformation" in str(e):
            return f"not checked yet (called inside a transformation): {e}"
        why = f"failed to run: {e}".strip()
    _SELF_CHECKS[tier] = why
    return why


def _compare_with_reference(tier: str, tol: float = 3e-3) -> str | None:
    # The tolerance leaves room for the reference's own fp32 matmuls, which MLX's CUDA backend
    # runs in TF32 (about 5e-4 apart at these sizes), and still catches a tier 1% off.
    k = mx.random.split(mx.random.key(1234), 6)
    h, w = mx.random.normal((70, 32), key=k[0]), 0.3 * mx.random.normal((300, 32), key=k[1])
    t = mx.where(mx.arange(70) % 9 == 0, -100, mx.random.randint(0, 300, (70,), key=k[2]))
    q = mx.random.normal((1, 4, 45, 32), key=k[3])
    kk, v = mx.random.normal((1, 2, 45, 32), key=k[4]), mx.random.normal((1, 2, 45, 32), key=k[5])

    def loss(impl):
        def f(h, w):
            fn = IMPLS[impl]
            return fn(h, w, t, -100, 0.1, 5.0)[0].sum()

        return mx.value_and_grad(f, argnums=(0, 1))(h, w)

    def attn(impl):
        def f(q, kk, v):
            return (ATTENTION_IMPLS[impl](q, kk, v, 32**-0.5, True, None) ** 2).sum()

        return mx.value_and_grad(f, argnums=(0, 1, 2))(q, kk, v)

    for what, run in (("linear_cross_entropy", loss), ("attention", attn)):
        got, want = run(tier), run("reference")
        mx.eval(got, want)
        pairs = [(got[0], want[0]), *zip(got[1], want[1], strict=True)]
        for a, b in pairs:
            err = (mx.linalg.norm(a - b) / mx.maximum(mx.linalg.norm(b), 1e-30)).item()
            if not err <= tol:  # NaN fails too
                return f"{what} differs from the reference (relative error {err:.1e})"
    return None


def best_impl() -> str:
    """The tier ``impl=None`` uses: the GPU kernels when the default device is that GPU and they
    pass ``self_check`` here, else the chunked tier."""
    if _GPU is not None and on_gpu() and self_check(_GPU) is None:
        return _GPU
    return "chunked"


def check_impl(impl: str | None, impls: dict = IMPLS) -> str | None:
    """None if ``impl`` (a tier name, or None for the best one) runs here, else why not
    (``impls``: the op's tiers, the loss's by default)."""
    if impl is None or impl in impls:
        return None
    if impl in ("metal", "cuda"):
        return f"the {impl!r} kernels need MLX's {impl} backend, which this machine does not have"
    if impl in TIERS:
        return f"{impl!r} is not a tier of this operation; choose from {list(impls)}"
    return f"unknown kernel tier {impl!r}; choose from {list(TIERS)}"


def resolve(choice: str | None, impls: dict = IMPLS) -> str:
    """The tier a kernel choice runs as on this machine. A tier name stands for itself; None or
    "auto" means MLXTUNE_KERNELS where it is set, else ``best_impl()``. Raises ValueError saying
    why the tier cannot run here (its message names MLXTUNE_KERNELS when the choice came from it).
    """
    env = os.environ.get("MLXTUNE_KERNELS")
    if choice in (None, "auto"):
        if not env:
            return best_impl()
        why = check_impl(env, impls)
        if why:
            raise ValueError(f"MLXTUNE_KERNELS={env}: {why}")
        return env
    why = check_impl(choice, impls)
    if why:
        raise ValueError(f"{why}; use auto (here: {best_impl()})")
    return choice


def _pick(impl: str | None, impls: dict = IMPLS, what: str = "linear_cross_entropy") -> str:
    try:
        tier = resolve(impl, impls)
    except ValueError as e:
        raise ValueError(f"{what}: {e} (available here: {', '.join(impls)})") from None
    if tier not in impls:
        raise ValueError(f"{what}: no {tier!r} tier (available here: {', '.join(impls)})")
    return tier


def linear_cross_entropy(
    hidden: mx.array,
    weight: mx.array,
    targets: mx.array,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    reduction: str = "sum",
    impl=None,
    weight_grad: bool = True,
) -> tuple[mx.array, mx.array]:
    # impl: a tier, or None / "auto" (MLXTUNE_KERNELS, else the best tier here): see resolve().
    """Cross-entropy of ``hidden @ weight.T`` against ``targets``: (loss, n_valid).

    hidden [N, D], weight [V, D] (the LM head), targets [N] int. Targets equal to
    ``ignore_index`` contribute nothing. ``reduction="sum"`` gives the loss summed over valid
    tokens; "mean" divides by their count; "none" gives [N] per-token losses (0 where ignored).
    ``label_smoothing`` mixes the one-hot target with the uniform distribution; ``softcap``
    applies ``c * tanh(z / c)`` to the logits first. Accumulates in fp32 whatever the dtype.
    ``weight_grad=False`` says the head is frozen: tiers that compute gradients themselves skip
    the head's (it comes back as zeros), saving a matmul per chunk in the backward; the chunked
    tier then also gathers the hidden state's gradient during the forward (see
    ``forward_only`` for calls that never take a gradient). ``weight`` may be a frozen quantized
    head as ``QuantizedRows``: the chunked tier de-quantizes a chunk of its rows at a time, the
    others the whole head.
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if hidden.ndim != 2 or weight.ndim != 2 or targets.ndim != 1:
        raise ValueError("expected hidden [N, D], weight [V, D] and targets [N]")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shapes do not match: hidden {hidden.shape}, weight {weight.shape}, targets {targets.shape}"
        )
    if impl is not None and not isinstance(impl, str):  # measured by shape (tune.Tuned)
        impl = impl.tier_at(hidden.shape[0])
    tier = _pick(impl)
    fn = IMPLS[tier]
    if tier != "chunked":  # the other tiers read a dense head
        weight = dense(weight)
    losses, valid = fn(
        hidden, weight, targets, ignore_index, label_smoothing, softcap, weight_grad=weight_grad
    )
    n_valid = valid.sum()
    if reduction == "none":
        return losses, n_valid
    total = losses.sum()
    if reduction == "mean":
        total = total / mx.maximum(n_valid, 1).astype(total.dtype)
    return total, n_valid


def linear_entropy(
    hidden: mx.array, weight, *, softcap: float | None = None, chunk: int | None = None
) -> mx.array:
    """Entropy [N] (fp32, nats) of the distribution softmax(hidden @ weight.T) of each row,
    ``softcap`` applied to the logits first as ``linear_cross_entropy`` applies it:
    logsumexp(z) - sum softmax(z) z. Never builds the [N, V] logits: it streams over vocabulary
    chunks of ``chunk`` columns (default: as the loss sizes them) with an online maximum, one
    [N, chunk] block at a time. Forward only: no gradient flows to ``hidden`` or ``weight``
    (what reads it, GRPO's entropy mask, takes none). ``weight`` may be ``QuantizedRows``."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, D] and weight [V, D], got {hidden.shape} and {weight.shape}"
        )
    return linear_entropy_chunked(hidden, weight, softcap, chunk)


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool = True,
    segment_ids: mx.array | None = None,
    impl=None,
) -> mx.array:
    """Scaled dot-product attention, [B, Hq, T, Dh] out.

    q [B, Hq, T, Dh], k and v [B, Hkv, T, Dh] with Hq a multiple of Hkv (grouped-query attention).
    ``segment_ids`` [B, T] keeps packed sequences apart: a query sees only keys of its own segment
    (and, with ``causal``, not after itself). The chunked tier saves the per-row logsumexp and
    recomputes probabilities block by block in the backward, never building [T, T] scores, except
    for rows whose scores hold at most ``flash.FUSED_SCORES`` elements, which go to MLX's fused
    attention.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            f"expected q [B, Hq, T, Dh] and k, v [B, Hkv, T, Dh]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {q.shape} does not fit k/v {k.shape} (Hq must be a multiple of Hkv)")
    if segment_ids is not None and segment_ids.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"segment_ids must be [B, T] = {(q.shape[0], q.shape[2])}, got {segment_ids.shape}"
        )
    if impl is not None and not isinstance(impl, str):  # measured by shape (tune.Tuned)
        impl = impl.tier_at(q.shape[2])
    fn = ATTENTION_IMPLS[_pick(impl, ATTENTION_IMPLS, "attention")]
    return fn(q, k, v, scale, causal, segment_ids)


__all__ = [
    "QuantizedRows",
    "attention",
    "available_impls",
    "best_impl",
    "forward_only",
    "linear_cross_entropy",
    "linear_entropy",
    "resolve",
    "self_check",
]
