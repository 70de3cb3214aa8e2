"""Tensor parallelism (``mlxtune.tensor``) on MLX's ring backend, two processes on this CPU:
each rank holds its share of every block's heads and MLP columns (each expert's, in a
mixture), computes on the whole batch, and gets the whole model's loss and, for every
parameter, its share of the whole model's gradient."""

import sys
from pathlib import Path

import pytest

from conftest import rank_results

LAUNCH = Path(sys.executable).with_name("mlx.launch")
WORKER = Path(__file__).with_name("tensor_worker.py")


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
@pytest.mark.parametrize(
    "mode",
    [  # suite time: the runs in test_fsdp_runs cover every mode through the trainer
        pytest.param("full", marks=pytest.mark.slow),
        pytest.param("lora", marks=pytest.mark.slow),
        pytest.param("qlora", marks=pytest.mark.slow),
        "moe-full",
        pytest.param("moe-lora", marks=pytest.mark.slow),
        pytest.param("moe-qlora", marks=pytest.mark.slow),
    ],
)
def test_a_split_step_equals_the_whole_one(tmp_path, mode):
    for got in rank_results(WORKER, tmp_path, mode):
        assert got["refusal"] is None
        if mode.endswith("qlora"):  # a quantized head stays whole, and says why
            assert "quantized" in got["head_whole"]
        else:  # split by vocabulary too
            assert got["head_whole"] is None
        assert got["loss"] == pytest.approx(got["want_loss"], rel=1e-5)
        # the quantized base: MLX's quantized product on a split layer against the whole one
        assert got["worst_grad"] < (2e-5 if mode.endswith("qlora") else 5e-6), got
        assert got["split"] > 0
        # every block's projections are halved (norms and routers stay whole: beside 4-bit
        # projections they weigh more)
        most = 0.65 if mode.endswith("qlora") else 0.55
        assert got["block_bytes"] < most * got["unsharded_block_bytes"]
        assert got["checkpoint_round_trip"]  # whole under the same names, and back
        assert got["unsharded_names"] and got["unsharded_logits"]


def test_what_cannot_be_split_is_named():
    import mlx.core as mx
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model
    from mlxtune.tensor import refusal

    mx.random.seed(0)
    mla, _ = build_model(tiny_config("deepseek_v3", 61), 61)
    assert "not split as heads and MLP columns" in refusal(mla, 2)
    fused, _ = build_model(tiny_config("phi3small", 61), 61)
    assert refusal(fused, 2) is not None


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
def test_each_rank_holds_half_of_every_projection_and_its_optimizer_state(tmp_path):
    """MLX's own counter: between steps of full fine-tuning with AdamW (weight and two
    moments: 12 bytes an element), a rank holds half of each block's projections and the rest
    whole (norms, the tied embedding)."""
    for got in rank_results(WORKER, tmp_path, "memory"):
        assert got["whole"] == pytest.approx(12 * (got["projections"] + got["rest"]), rel=0.02)
        want = 12 * (got["projections"] / 2 + got["rest"])
        assert got["split"] == pytest.approx(want, rel=0.02), got


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
def test_the_loss_over_a_head_split_by_vocabulary_is_the_whole_heads():
    """Each rank's rows of the head: the cross-entropy (summed and per token, with and without
    label smoothing, some positions no target) and the gradients of the hidden states and of
    each rank's rows equal the whole head's through the one-process kernel."""
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        for got in rank_results(WORKER, Path(t), "loss"):
            assert got["worst"] < 1e-5, got
