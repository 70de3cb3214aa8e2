"""Fully sharded data parallelism (``mlxtune.fsdp``) on MLX's ring backend, two processes on
this CPU: the loss and every gradient of a sharded step equal the unsharded step's, and each
rank holds half of what trains."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import rank_results
from mlxtune.fsdp import shard_of

LAUNCH = Path(sys.executable).with_name("mlx.launch")
WORKER = Path(__file__).with_name("fsdp_worker.py")


def test_pieces_of_any_shape_join_back():
    a = mx.arange(5 * 3 * 2, dtype=mx.float32).reshape(5, 3, 2)
    for n in (1, 2, 4, 7):
        pieces = [np.array(shard_of(a, n, r)) for r in range(n)]
        assert {p.shape for p in pieces} == {(-(-5 // n), 3, 2)}  # equal, as many dimensions
        joined = np.concatenate(pieces)
        np.testing.assert_array_equal(joined[:5], np.arange(30).reshape(5, 3, 2))
        np.testing.assert_array_equal(joined[5:], 0)  # the padding: whole zero rows
    np.testing.assert_array_equal(np.array(shard_of(mx.array(3.0), 2, 0)), [3.0])
    np.testing.assert_array_equal(np.array(shard_of(mx.array(3.0), 2, 1)), [0.0])


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
@pytest.mark.parametrize(
    "mode",
    [  # suite time: the runs in test_fsdp_runs train full and LoRA through the trainer too
        pytest.param("full", marks=pytest.mark.slow),
        pytest.param("lora", marks=pytest.mark.slow),
        "full-recomputed",
    ],
)
def test_a_sharded_step_equals_the_unsharded_one(tmp_path, mode):
    for got in rank_results(WORKER, tmp_path, mode):
        assert got["scatter"] == "all_sum"  # ring has no sum_scatter: the fallback ran
        assert got["loss"] == pytest.approx(got["want_loss"], rel=1e-5)
        assert got["worst_grad"] < 1e-5, got
        # every parameter of the blocks (a LoRA run's frozen base too) is halved, up to the
        # padding of odd sizes; the embedding and head stay whole
        assert got["block_bytes"] <= got["unsharded_block_bytes"] / 2 + 64
        assert got["trainable_bytes"] < got["unsharded_bytes"]
        # a checkpoint's weights: whole, under the unsharded names, read back at any world size
        assert got["checkpoint_round_trip"]
        assert got["units_recompute"]
        assert got["pieces"] == got["block_params"]
        # the blocks whole again (before rank 0 alone exports or samples): the same model
        assert got["unsharded_names"] and got["unsharded_logits"]
        if mode == "lora":  # everything that trains is in the blocks
            assert got["trainable_bytes"] * 2 == got["unsharded_bytes"]


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
def test_each_rank_holds_half_the_blocks_weights_and_optimizer_state(tmp_path):
    """MLX's own counter: what a rank holds between steps of full fine-tuning with AdamW
    (weight, two moments: 12 bytes an element) is the part outside the blocks and half of the
    blocks, within the padding and the optimizer's step count."""
    for got in rank_results(WORKER, tmp_path, "memory"):
        per_element = 12
        assert got["whole"] == pytest.approx(
            per_element * (got["outside"] + got["blocks"]), rel=0.02
        )
        want = per_element * (got["outside"] + got["blocks"] / 2)
        assert got["sharded"] == pytest.approx(want, rel=0.02), got
