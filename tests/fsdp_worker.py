"""One rank of a fully sharded step (``mlxtune.fsdp``) against the unsharded one, under
``mlx.launch``: ``fsdp_worker.py OUT MODE`` (MODE: full or lora, with
"-recomputed" for gradient checkpointing) writes what it found to
OUT/rank-R.json."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from conftest import held_after_a_step, shake_adapters, tiny_arch  # noqa: E402
from mlxtune.adapters import adapt_model  # noqa: E402
from mlxtune.fsdp import (  # noqa: E402
    ShardedUnit,
    put_whole_trainable,
    scatter_kind,
    shard_blocks,
    sharded_paths,
    unshard_blocks,
    whole_trainable,
)
from mlxtune.models import build_model, checkpoint_layers, checkpointed_layers  # noqa: E402


def loss_sum(model, x, y):
    logits = model(x).astype(mx.float32)
    return nn.losses.cross_entropy(logits, y, reduction="sum")


def memory(out: Path, group) -> None:
    """What a rank holds between steps, sharded and not (weights and optimizer state)."""
    whole, sizes = held_after_a_step(lambda m: None)
    sharded, _ = held_after_a_step(lambda m: shard_blocks(m, group))
    blocks = sum(n for k, n in sizes.items() if k.startswith("model.layers."))
    outside = sum(sizes.values()) - blocks
    result = {"whole": whole, "sharded": sharded, "outside": outside, "blocks": blocks}
    (out / f"rank-{group.rank()}.json").write_text(json.dumps(result))


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    group = mx.distributed.init()
    if mode == "memory":
        return memory(out, group)
    n, rank = group.size(), group.rank()
    model, _ = build_model(tiny_arch("llama", num_key_value_heads=1), 61, seed=7)
    if mode.endswith("-recomputed"):  # gradient checkpointing, handed to the units
        mode = mode.removesuffix("-recomputed")
        checkpoint_layers(model)
    if mode == "lora":
        adapt_model(model, "lora", 4, 8, 0.0, ["all-linear"], None, False)
        shake_adapters(model)
    else:
        model.unfreeze()
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, 61, (4, 13), key=mx.random.key(11))
    x, y = tokens[:, :-1], tokens[:, 1:]
    count = y.size

    def loss(m, x, y):
        return loss_sum(m, x, y) / count

    original = dict(tree_flatten(model.trainable_parameters()))
    original_all = dict(tree_flatten(model.parameters()))
    want_logits = model(x)
    want_loss, want = nn.value_and_grad(model, loss)(model, x, y)
    want = dict(tree_flatten(want))
    held = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    blocks_held = sum(v.nbytes for _, v in tree_flatten([b.parameters() for b in model.layers]))
    mx.eval(want_loss, want, want_logits)

    recomputed = checkpointed_layers(model)
    shard_blocks(model, group)
    units_recompute = checkpointed_layers(model) == recomputed
    mine = slice(rank, None, n)  # this rank's rows of the batch
    got_loss, got = nn.value_and_grad(model, loss)(model, x[mine], y[mine])
    got_loss = mx.distributed.all_sum(got_loss, group=group)
    pieces = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    blocks_pieces = sum(v.nbytes for _, v in tree_flatten([b.parameters() for b in model.layers]))
    worst = 0.0
    for k, g in tree_flatten(got):
        name = k.replace(".module.", ".")
        w = want[name]
        if k != name:  # a block's piece: the whole gradient gathered from every rank's piece
            block = model.layers[int(k.split(".")[2])]
            assert isinstance(block, ShardedUnit)
            rows = mx.distributed.all_gather(g, group=group)  # the pieces' rows, in rank order
            g = rows.reshape(w.shape) if w.ndim == 0 else rows[: w.shape[0]]
        else:  # outside the blocks: replicated, summed as data parallelism does
            g = mx.distributed.all_sum(g, group=group)
        worst = max(worst, (mx.abs(g - w).max() / (mx.abs(w).max() + 1e-12)).item())
    # what a checkpoint writes: the whole trained weights under the unsharded names
    before = dict(tree_flatten(model.trainable_parameters()))
    whole = whole_trainable(model)
    trained_names = set(dict(tree_flatten(want)))
    same = whole.keys() == trained_names and all(
        mx.array_equal(whole[k], original[k]).item() for k in whole
    )
    # read back at any world size: every rank keeps its pieces of the whole values
    put_whole_trainable(model, {k: v + 1 for k, v in whole.items()})
    again = whole_trainable(model)
    moved = all(mx.array_equal(again[k], whole[k] + 1).item() for k in whole)
    put_whole_trainable(model, whole)
    n_pieces = len(sharded_paths(model))
    unshard_blocks(model)  # whole blocks back: rank 0 alone may now use the model
    after = dict(tree_flatten(model.parameters()))
    logits_equal = mx.allclose(model(x), want_logits, atol=1e-5).item()
    del before
    result = {
        "checkpoint_round_trip": same and moved,
        "units_recompute": units_recompute,
        "pieces": n_pieces,
        "block_params": sum(len(tree_flatten(b.parameters())) for b in model.layers),
        "unsharded_names": after.keys() == original_all.keys(),
        "unsharded_logits": logits_equal,
        "loss": got_loss.item(),
        "want_loss": want_loss.item(),
        "worst_grad": worst,
        "grads": len(want),
        "trainable_bytes": pieces,
        "unsharded_bytes": held,
        "block_bytes": blocks_pieces,  # every parameter of the blocks, frozen ones included
        "unsharded_block_bytes": blocks_held,
        "scatter": scatter_kind(group),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
