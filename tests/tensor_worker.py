"""One rank of a tensor-parallel step (``mlxtune.tensor``) against the whole model's, under
``mlx.launch``: ``tensor_worker.py OUT MODE`` (MODE: full, lora or qlora, each also as moe-MODE; or memory) writes what it
found to OUT/rank-R.json."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from conftest import held_after_a_step, shake_adapters, tiny_arch  # noqa: E402
from mlxtune.adapters import adapt_model  # noqa: E402
from mlxtune.models import build_model, lm_parts, quantize_model  # noqa: E402
from mlxtune.tensor import (  # noqa: E402
    put_whole_trainable,
    refusal,
    shard_tensors,
    sharded_axes,
    split_head,
    unshard_tensors,
    whole_trainable,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def memory(out: Path, group) -> None:
    """What a rank holds between steps, split and not (weights and optimizer state)."""
    whole, sizes = held_after_a_step(lambda m: None)
    split, _ = held_after_a_step(lambda m: shard_tensors(m, group))
    projections = sum(n for k, n in sizes.items() if k.split(".")[-2] in PROJECTIONS)
    rest = sum(sizes.values()) - projections
    result = {"whole": whole, "split": split, "projections": projections, "rest": rest}
    (out / f"rank-{group.rank()}.json").write_text(json.dumps(result))


def split_loss(out: Path, group) -> None:
    """The cross-entropy over a head whose vocabulary rows are split among the ranks, against
    the whole head's through the one-process kernel: values, and the gradients of the hidden
    states and of this rank's rows, summed, per token and with label smoothing."""
    from mlxtune.kernels import linear_cross_entropy
    from mlxtune.tensor import split_cross_entropy

    n, rank = group.size(), group.rank()
    h = mx.random.normal((12, 16), key=mx.random.key(1))
    w = mx.random.normal((64, 16), key=mx.random.key(2)) * 0.5
    t = mx.random.randint(0, 64, (12,), key=mx.random.key(3))
    t = mx.where(mx.arange(12) % 5 == 4, -100, t)  # some positions are no target
    k = 64 // n
    mine = w[rank * k : (rank + 1) * k]
    worst = 0.0
    for reduction in ("sum", "none"):
        for smoothing in (0.0, 0.1):

            def whole(h, w, smoothing=smoothing, reduction=reduction):
                loss, _ = linear_cross_entropy(
                    h, w, t, label_smoothing=smoothing, reduction=reduction, impl="reference"
                )
                return (loss * mx.arange(1, loss.size + 1)).sum()  # every position weighed

            def split(h, w, smoothing=smoothing, reduction=reduction):
                loss, _ = split_cross_entropy(
                    h, w, t, (group, rank * k), ignore_index=-100,
                    label_smoothing=smoothing, reduction=reduction, impl="chunked",
                )  # fmt: skip
                return (loss * mx.arange(1, loss.size + 1)).sum()

            want, (dh, dw) = mx.value_and_grad(whole, argnums=(0, 1))(h, w)
            got, (gh, gw) = mx.value_and_grad(split, argnums=(0, 1))(h, mine)
            for a, b in ((got, want), (gh, dh), (gw, dw[rank * k : (rank + 1) * k])):
                worst = max(worst, (mx.abs(a - b).max() / (mx.abs(b).max() + 1e-12)).item())
    (out / f"rank-{rank}.json").write_text(json.dumps({"worst": worst}))


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    if mode == "memory":
        return memory(out, group)
    if mode == "loss":
        return split_loss(out, group)
    if mode.startswith("moe-"):  # a mixture of experts: each expert's columns split
        from mlx_lm_archs import tiny_config

        mode = mode.removeprefix("moe-")
        # experts 64 wide: each rank's 32 columns are whole groups of a 4-bit base
        arch = {**tiny_config("qwen3_moe", 64), "moe_intermediate_size": 64}
    else:
        arch = tiny_arch("llama", hidden_size=64, intermediate_size=128, num_key_value_heads=2)
    model, _ = build_model(arch, 64, seed=7)  # a vocabulary the ranks split
    if mode == "qlora":
        quantize_model(model, 4, 32)
    if mode in ("lora", "qlora"):
        adapt_model(model, "lora", 4, 8, 0.0, ["all-linear"], None, False)
        shake_adapters(model)
    else:
        model.unfreeze()
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, 61, (3, 13), key=mx.random.key(11))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss(m, x, y):
        logits = m(x).astype(mx.float32)
        return nn.losses.cross_entropy(logits, y, reduction="mean")

    want_logits = model(x)
    want_loss, want = nn.value_and_grad(model, loss)(model, x, y)
    want = dict(tree_flatten(want))
    before = dict(tree_flatten(model.trainable_parameters()))
    mx.eval(want_loss, want, want_logits)
    why = refusal(model, n)
    shard_tensors(model, group)
    lm = lm_parts(model)
    head_whole = split_head(model, lm.head_path, lm.softcap, group)
    mx.eval(model.parameters())
    axes = sharded_axes(model)
    got_loss, got = nn.value_and_grad(model, loss)(model, x, y)  # every rank: the whole batch
    worst, worst_at = 0.0, None
    for k, g in tree_flatten(got):
        w = want[k]
        if k in axes:  # this rank's share: the whole gradient's rows or columns
            a = axes[k]
            g = mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(g, a, 0), group=group), 0, a)
        err = (mx.abs(g - w).max() / (mx.abs(w).max() + 1e-12)).item()
        if err > worst:
            worst, worst_at = err, k
    whole = whole_trainable(model)
    same = whole.keys() == before.keys() and all(
        mx.array_equal(whole[k], before[k]).item() for k in whole
    )
    put_whole_trainable(model, {k: v + 1 for k, v in whole.items()})
    again = whole_trainable(model)
    moved = all(mx.array_equal(again[k], whole[k] + 1).item() for k in whole)
    put_whole_trainable(model, whole)
    held = sum(v.nbytes for _, v in tree_flatten([b.parameters() for b in model.layers]))
    unshard_tensors(model)
    whole_bytes = sum(v.nbytes for _, v in tree_flatten([b.parameters() for b in model.layers]))
    after = dict(tree_flatten(model.trainable_parameters()))
    result = {
        "refusal": why,
        "head_whole": head_whole,
        "loss": got_loss.item(),
        "want_loss": want_loss.item(),
        "worst_grad": worst,
        "worst_at": worst_at,
        "split": len(axes),
        "checkpoint_round_trip": same and moved,
        "block_bytes": held,
        "unsharded_block_bytes": whole_bytes,
        "unsharded_names": after.keys() == before.keys(),
        "unsharded_logits": mx.allclose(model(x), want_logits, atol=1e-5).item(),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
