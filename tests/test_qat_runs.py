"""Quantization-aware training in a run (``train.qat``): prepared layers compute with their
(merged) weight fake-quantized and pass the gradient straight through (against NumPy), a run
trains its adapters over a frozen base, reports the quantized and unquantized eval losses,
resumes exactly, and exports the codes it trained with: the fused model mlx-lm reads and the
GGUF llama.cpp reads give its QAT eval loss back."""

import json

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from test_gguf import llama_cpp_forward, read
from test_preference import pair_rows

from conftest import (
    build_run,
    crash_and_resume,
    refused_run,
    run_rows,
    same_rows,
    tiny_recipe,
    write_splits,
)
from mlxtune import qat
from mlxtune.adapters import DoRALinear, LoRALinear
from mlxtune.cli import main
from mlxtune.models import load_model
from mlxtune.runs.checkpoint import load_trained

SPEC = qat.Spec(4, 32, "affine")


def fq(w: np.ndarray, spec=SPEC) -> np.ndarray:
    """The format's values of ``w``: MLX's quantize then dequantize (the format's definition)."""
    parts = mx.quantize(mx.array(w), group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    return np.array(mx.dequantize(*parts, group_size=spec.group_size, bits=spec.bits))


def test_a_prepared_lora_layer_quantizes_its_merged_weight_and_passes_gradients_straight():
    rng = np.random.default_rng(0)
    base = nn.Linear(64, 48, bias=True)
    layer = LoRALinear.from_base(base, rank=4, alpha=8.0)
    layer.lora_b = mx.array(rng.standard_normal((4, 48)).astype(np.float32) * 0.1)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    c = rng.standard_normal((3, 5, 48)).astype(np.float32)  # the loss's cotangent
    plain = np.array(layer(mx.array(x)))
    qat.install_layer(layer, SPEC)
    W, b = np.array(base.weight), np.array(base.bias)
    A, B, s = np.array(layer.lora_a), np.array(layer.lora_b), layer.scale
    merged = (W + s * (A @ B).T).astype(np.float32)
    np.testing.assert_allclose(np.array(layer(mx.array(x))), plain, rtol=1e-5, atol=1e-5)
    with qat.quantizing():
        got = np.array(layer(mx.array(x)))

        def loss(a, b_):
            layer.lora_a, layer.lora_b = a, b_
            return (layer(mx.array(x)) * mx.array(c)).sum()

        da, db = mx.grad(loss, argnums=(0, 1))(mx.array(A), mx.array(B))
    np.testing.assert_allclose(got, x @ fq(merged).T + b, rtol=1e-5, atol=1e-5)
    assert np.abs(got - plain).max() > 1e-3  # it quantizes
    # straight through: dL/dM = c^T x as if M were used as it is; M = W + s (A B)^T
    dm = np.einsum("tbo,tbi->oi", c, x)
    np.testing.assert_allclose(np.array(da), s * dm.T @ B.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(db), s * A.T @ dm.T, rtol=1e-4, atol=1e-4)


def test_prepared_dense_layers_experts_and_dora_compute_with_the_format():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    dense = nn.Linear(64, 32)
    qat.install_layer(dense, SPEC)
    c = rng.standard_normal((4, 32)).astype(np.float32)
    W = np.array(dense.weight)

    def loss(w):
        dense.weight = w
        return (dense(mx.array(x)) * mx.array(c)).sum()

    with qat.quantizing():
        y = np.array(dense(mx.array(x)))
        g = mx.grad(loss)(mx.array(W))
    np.testing.assert_allclose(y, x @ fq(W).T + np.array(dense.bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(g), c.T @ x, rtol=1e-4, atol=1e-4)
    # experts: each token's chosen expert, its weight quantized
    experts = SwitchLinear(64, 32, 3, bias=False)
    qat.install_layer(experts, SPEC)
    idx = mx.array([[0], [2], [1], [2]])
    with qat.quantizing():
        ye = np.array(experts(mx.array(x)[:, None, None, :], idx))
    We = np.array(experts.weight)
    want = np.stack([x[i] @ fq(We[int(idx[i, 0])]).T for i in range(4)])
    np.testing.assert_allclose(ye.reshape(4, 32), want, rtol=1e-5, atol=1e-5)
    # DoRA: the merged weight is the renormalised one
    dora = DoRALinear.from_base(nn.Linear(64, 32, bias=False), rank=4, alpha=8.0)
    dora.lora_b = mx.array(rng.standard_normal((4, 32)).astype(np.float32) * 0.1)
    qat.install_layer(dora, SPEC)
    with qat.quantizing():
        yd = np.array(dora(mx.array(x)))
    np.testing.assert_allclose(yd, x @ fq(np.array(dora.merged())).T, rtol=1e-5, atol=1e-5)


def qat_recipe(data_dir, model_dir, adapter="lora", formats=(), **q):
    r = tiny_recipe(data_dir, model_dir, export={"formats": list(formats)})
    r["adapter"] = {**r["adapter"], "type": adapter, "targets": ["q_proj", "v_proj", "down_proj"]}
    r["optimizer"] = {"lr": 1e-4}
    r["train"] = {**r["train"], "log_every": 1, "qat": {"bits": 4, "group_size": 32, **q}}
    return r


def valid_loss(forward, examples) -> float:
    """Token-weighted cross-entropy over ``examples`` (NumPy float64) of ``forward(ids)``'s
    logits: position t's target is token t + 1, counted where its mask says."""
    total = count = 0.0
    for e in examples:
        z = forward(e.ids).astype(np.float64)[:-1]
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        m = np.array(e.mask[1:], dtype=np.float64)
        total -= (logp[np.arange(len(z)), e.ids[1:]] * m).sum()
        count += m.sum()
    return total / count


def test_a_lora_run_trains_quantized_from_its_start_step_and_exports_its_codes(
    tmp_path, data_dir, llama_dir
):
    from mlx_lm.utils import load as mlx_lm_load

    r = qat_recipe(data_dir, llama_dir, formats=["fused", "gguf"], start_step=2)
    tr = build_run(r, tmp_path, "qat")
    tr.run()
    plain = {**r, "train": {k: v for k, v in r["train"].items() if k != "qat"}, "export": {}}
    build_run(plain, tmp_path, "plain").run()
    rows, base_rows = run_rows(tmp_path / "qat"), run_rows(tmp_path / "plain")
    losses = [x["loss"] for x in rows if "loss" in x]
    plain_losses = [x["loss"] for x in base_rows if "loss" in x]
    assert losses[:2] == plain_losses[:2]  # full precision until step 2
    assert all(abs(a - b) > 1e-6 for a, b in zip(losses[2:], plain_losses[2:], strict=True))
    evals = [x for x in rows if "eval_loss" in x]
    assert all(abs(e["eval_loss"] - e["eval_loss_unquantized"]) > 1e-5 for e in evals)
    # the base stayed frozen: its weights are the model directory's
    base = dict(nn.utils.tree_flatten(load_model(llama_dir)[0].parameters()))
    trained = dict(nn.utils.tree_flatten(tr.model.parameters()))
    for k, v in base.items():
        name = k.replace(".q_proj.", ".q_proj.linear.").replace(".v_proj.", ".v_proj.linear.")
        name = name.replace(".down_proj.", ".down_proj.linear.")
        assert mx.array_equal(trained.get(name, trained.get(k)), v).item(), k
    final = evals[-1]["eval_loss"]
    t = load_trained(tmp_path / "qat")

    def quantized(ids):
        with qat.quantizing():
            return np.array(t.model(mx.array([ids]))[0])

    examples = list(tr.valid_set.examples)
    assert valid_loss(quantized, examples) == pytest.approx(final, rel=1e-5)
    # mlx-lm reads the fused export: the blocks' linear layers quantized, with those codes
    fused, _ = mlx_lm_load(str(tmp_path / "qat" / "export" / "fused"))
    layers = dict(fused.named_modules())
    assert sorted(p for p, m in layers.items() if isinstance(m, nn.QuantizedLinear)) == sorted(
        qat.prepared(t.model)
    )
    assert isinstance(layers["model.embed_tokens"], nn.Embedding)
    ids = examples[0].ids
    np.testing.assert_allclose(
        np.array(fused(mx.array([ids]))[0]), quantized(ids), rtol=1e-5, atol=1e-5
    )
    assert valid_loss(lambda i: np.array(fused(mx.array([i]))[0]), examples) == pytest.approx(
        final, rel=1e-5
    )
    # the GGUF holds them as Q4_1 (scales and biases in fp16), the rest f16, as llama.cpp reads it
    path = next((tmp_path / "qat" / "export" / "gguf").glob("*.gguf"))
    assert path.name.endswith("-q4_1.gguf")
    f, tensors, reader = read(path)
    types = {x.name: x.tensor_type for x in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_1
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    got = valid_loss(lambda i: llama_cpp_forward(f, tensors, i), examples)
    assert got == pytest.approx(final, rel=2e-3)


def test_full_qat_with_checkpointing_resumes_exactly(tmp_path, data_dir, llama_dir):
    r = qat_recipe(data_dir, llama_dir, adapter="full", start_step=2)
    r["train"]["grad_checkpointing"] = True
    r["checkpoints"] = {"every": 1}
    build_run(r, tmp_path, "whole").run()
    cut = crash_and_resume(r, tmp_path, at=3)
    same_rows(run_rows(cut), run_rows(tmp_path / "whole"), rel=0, abs=0)
    # checkpointing recomputes the same quantized forward
    r["train"]["grad_checkpointing"] = False
    build_run(r, tmp_path, "kept").run()
    same_rows(run_rows(tmp_path / "kept"), run_rows(tmp_path / "whole"), rel=1e-5)


def test_a_preference_objective_trains_quantization_aware(tmp_path, llama_dir):
    prefs = write_splits(tmp_path / "prefs", pair_rows, 24, 8)
    r = qat_recipe(prefs, llama_dir)
    r["objective"] = {"type": "dpo", "beta": 0.1}
    r["train"] = {**r["train"], "batch_size": 4, "max_steps": 3}
    tr = build_run(r, tmp_path)
    tr.run()
    e = [x for x in run_rows(tmp_path / "run") if "eval_loss" in x][-1]
    assert np.isfinite(e["eval_loss"]) and e["eval_loss"] != e["eval_loss_unquantized"]


@pytest.mark.parametrize(
    "change, key",
    [
        ({"train.qat.group_size": 64}, "train.qat.group_size"),  # the tiny model is 32 wide
        ({"train.qat.bits": 7}, "train.qat.bits"),
        ({"train.qat.mode": "mxfp4", "train.qat.group_size": 16}, "train.qat.group_size"),
        ({"train.qat.mode": "mxfp8", "train.qat.bits": 8, "export": ["gguf"]}, "export.formats"),
        ({"train.qat.bits": 8, "export": ["gguf"]}, "export.formats"),
        ({"adapter.dropout": 0.1}, "adapter.dropout"),
        (
            {"objective": {"type": "grpo", "rewards": [{"name": "length", "target": 3}]}},
            "train.qat",
        ),
    ],
)
def test_what_qat_cannot_do_is_refused_naming_the_key(
    tmp_path, data_dir, llama_dir, capsys, change, key
):
    r = qat_recipe(data_dir, llama_dir)
    for k, v in change.items():
        if k == "export":
            r["export"] = {"formats": v}
        elif k == "objective":
            r["objective"] = v
        elif k.startswith("train.qat."):
            r["train"]["qat"][k.rsplit(".", 1)[1]] = v
        else:
            r["adapter"][k.rsplit(".", 1)[1]] = v
    err = refused_run(r, tmp_path, capsys)
    assert key in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_export_keeps_the_trained_codes_or_says_why_not(tmp_path, data_dir, llama_dir, capsys):
    r = qat_recipe(data_dir, llama_dir)
    r["train"]["max_steps"] = 2
    build_run(r, tmp_path).run()
    run = str(tmp_path / "run")
    # another quantization would lose what QAT learned
    assert (
        main(["export", run, "--format", "fused", "--quantize", "8", "--out", str(tmp_path / "a")])
        == 2
    )
    assert "--quantize" in capsys.readouterr().err
    # as trained: quantized (the config says how); --dtype: full precision
    assert main(["export", run, "--format", "fused", "--out", str(tmp_path / "q")]) == 0
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"bits": 4, "group_size": 32, "mode": "affine"}
    assert (
        main(
            ["export", run, "--format", "fused", "--dtype", "float32", "--out", str(tmp_path / "d")]
        )
        == 0
    )
    assert "quantization" not in json.loads((tmp_path / "d" / "config.json").read_text())


def test_the_memory_plan_counts_the_quantized_copies(tmp_path, tokenizer, tokenizer_dir):
    import gc
    import random

    from conftest import measured_peak, tiny_arch, write_jsonl
    from mlxtune.memory import estimate, shape_of
    from mlxtune.models import build_model, save_model

    arch = tiny_arch("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4)
    model, config = build_model(arch, len(tokenizer._tokenizer), seed=1)
    save_model(model, config, tmp_path / "model", tokenizer, tokenizer_dir)
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    rows = [{"text": " ".join(rng.choice(words) for _ in range(60))} for _ in range(8)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    r = {
        "model": {"path": str(tmp_path / "model")},
        "data": {"train": str(tmp_path / "train.jsonl"), "format": "text", "max_length": 64},
        "adapter": {"type": "lora", "targets": ["all-linear"]},
        "kernels": {"loss": "chunked", "attention": "native"},
        "train": {"batch_size": 2, "max_steps": 2, "progress": False},
        "eval": {"every": None},
    }
    plain_peak = measured_peak(build_run(r, tmp_path, "plain"))
    gc.collect()  # that run's model and buffers gone before the next is built
    mx.clear_cache()
    r["train"]["qat"] = {"bits": 4, "group_size": 64}
    tr = build_run(r, tmp_path, "qat")
    peak, planned = measured_peak(tr), estimate(shape_of(tr))
    # every block's fake-quantized copies, kept for the backward, and one block's gradients of
    # its merged weights: measured 63 MB here, as planned
    assert 0.6 < planned["qat"] / (peak - plain_peak) < 1.6, (planned, peak, plain_peak)
    assert 0.8 < planned["total"] / peak < 1.5
    # a learned quantization of the same model, its teacher beside it
    del tr
    gc.collect()
    mx.clear_cache()
    del r["adapter"], r["train"]["qat"]
    r["objective"] = {
        "type": "distill",
        "teacher": str(tmp_path / "model"),
        "student_quantization": {"bits": 4, "group_size": 64},
    }
    tr = build_run(r, tmp_path, "learned")
    peak, planned = measured_peak(tr), estimate(shape_of(tr))
    assert planned["qat"] > 0 and 0.8 < planned["total"] / peak < 1.5, (planned, peak)


def test_a_learned_quantization_layer_passes_gradients_to_its_scales_and_biases():
    rng = np.random.default_rng(2)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(64, 16, bias=False), group_size=32, bits=4)
    qat.learn_scales(layer)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    c = rng.standard_normal((5, 16)).astype(np.float32)
    s, b = np.array(layer.scales), np.array(layer.biases)
    codes = np.array(mx.dequantize(layer.weight, mx.ones_like(layer.scales),
                                   mx.zeros_like(layer.biases), 32, 4))  # fmt: skip

    def loss(s_, b_):
        layer.scales, layer.biases = s_, b_
        return (layer(mx.array(x)) * mx.array(c)).sum()

    ds, db = mx.grad(loss, argnums=(0, 1))(mx.array(s), mx.array(b))
    # W = s q + b per group of 32: dL/ds = sum over the group of dW q, dL/db = sum of dW
    dw = (c.T @ x).reshape(16, 2, 32)
    np.testing.assert_allclose(np.array(ds), (dw * codes.reshape(16, 2, 32)).sum(-1), rtol=1e-4)
    np.testing.assert_allclose(np.array(db), dw.sum(-1), rtol=1e-4, atol=1e-5)
    assert set(dict(nn.utils.tree_flatten(layer.trainable_parameters()))) == {"scales", "biases"}


def test_learned_quantization_distils_the_model_into_its_quantized_copy(
    tmp_path, data_dir, llama_dir
):
    from mlx_lm.utils import load as mlx_lm_load

    from mlxtune.models import quantize_model

    r = tiny_recipe(data_dir, llama_dir, export={"formats": ["fused"]})
    del r["adapter"]  # what trains is the scales and biases
    r["objective"] = {
        "type": "distill",
        "teacher": str(llama_dir),
        "student_quantization": {"bits": 4, "group_size": 32},
        "alpha": 1.0,
    }
    r["optimizer"] = {"lr": 1e-4}
    r["train"] = {**r["train"], "max_steps": 16, "log_every": 1}
    r["eval"] = {"every": 16, "at_start": True}
    tr = build_run(r, tmp_path)
    tr.run()
    evals = [x["eval_loss"] for x in run_rows(tmp_path / "run") if "eval_loss" in x]
    assert evals[-1] < 0.8 * evals[0]  # closer to the teacher than the plain quantized copy
    # the codes are those MLX's quantize gives the base; only scales and biases moved
    ptq = load_model(llama_dir)[0]
    quantize_model(ptq, 4, 32)
    want = dict(nn.utils.tree_flatten(ptq.parameters()))
    got = dict(nn.utils.tree_flatten(tr.model.parameters()))
    moved = {k for k in want if not mx.array_equal(want[k], got[k]).item()}
    assert moved and all(k.endswith((".scales", ".biases")) for k in moved), moved
    # mlx-lm reads the fused export: the same quantized model, the learned scales in it
    fused, _ = mlx_lm_load(str(tmp_path / "run" / "export" / "fused"))
    ids = tr.valid_set.examples[0].ids
    tr.model.eval()
    np.testing.assert_allclose(
        np.array(fused(mx.array([ids]))), np.array(tr.model(mx.array([ids]))), rtol=1e-4, atol=1e-4
    )
    t = load_trained(tmp_path / "run")  # the checkpoint rebuilds it
    np.testing.assert_allclose(
        np.array(t.model(mx.array([ids]))), np.array(tr.model(mx.array([ids]))), atol=1e-5
    )
    # no adapter to export; GGUF only as its de-quantized weights
    run = str(tmp_path / "run")
    assert main(["export", run, "--format", "mlx-lm", "--out", str(tmp_path / "a")]) == 2
    assert main(["export", run, "--format", "gguf", "--out", str(tmp_path / "g")]) == 2
    assert (
        main(["export", run, "--format", "gguf", "--dtype", "f32", "--out", str(tmp_path / "f")])
        == 0
    )


@pytest.mark.parametrize(
    "change, key",
    [
        ({"adapter": {"type": "lora"}}, "adapter"),
        ({"export": {"formats": ["gguf"]}}, "export.formats"),
        ({"model": {"quantize": {"bits": 4, "group_size": 32}}}, "model.quantize"),
        ({"objective": {"student_quantization": {"bits": 7, "group_size": 32}}},
         "objective.student_quantization.bits"),
    ],
)  # fmt: skip
def test_what_learned_quantization_cannot_do_is_refused(
    tmp_path, data_dir, llama_dir, capsys, change, key
):
    r = tiny_recipe(data_dir, llama_dir)
    del r["adapter"]
    r["objective"] = {
        "type": "distill",
        "teacher": str(llama_dir),
        "student_quantization": {"bits": 4, "group_size": 32},
    }
    for k, v in change.items():
        r[k] = {**r.get(k, {}), **v}
    err = refused_run(r, tmp_path, capsys)
    assert key in err and "Traceback" not in err, err


@pytest.mark.parametrize("setting", ["qlora", "bfloat16"])
def test_qat_over_a_quantized_base_and_in_bf16_exports_what_it_computed(
    tmp_path, data_dir, llama_dir, setting
):
    """QLoRA + QAT: the layers QLoRA leaves quantized ship with their codes, the adapted ones
    with the merged weights' codes; bf16: the codes of the bf16 merged weights."""
    from mlx_lm.utils import load as mlx_lm_load

    r = qat_recipe(data_dir, llama_dir, formats=["fused"])
    r["train"]["max_steps"] = 3
    if setting == "qlora":
        r["model"]["quantize"] = {"bits": 4, "group_size": 32}
    else:
        r["model"]["dtype"] = "bfloat16"
    tr = build_run(r, tmp_path)
    tr.run()
    tr.model.eval()
    ids = tr.valid_set.examples[0].ids
    with qat.quantizing():
        want = np.array(tr.model(mx.array([ids])).astype(mx.float32))
    fused, _ = mlx_lm_load(str(tmp_path / "run" / "export" / "fused"))
    quantized = {p for p, m in fused.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert set(qat.prepared(tr.model)) <= quantized
    if setting == "qlora":  # k_proj, o_proj, gate and up: QLoRA's codes as they were
        assert len(quantized) == 14
    got = np.array(fused(mx.array([ids])).astype(mx.float32))
    tol = 1e-5 if setting == "qlora" else 3e-2  # bf16: its products' round-off
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_a_start_step_the_run_never_reaches_is_reported(data_dir, llama_dir):
    from mlxtune import recipe_from_dict
    from mlxtune.config import inert_keys

    r = qat_recipe(data_dir, llama_dir, start_step=6)  # the run has 6 steps
    assert [k for k, _ in inert_keys(recipe_from_dict(r))] == ["train.qat.start_step"]
    r["train"]["qat"]["start_step"] = 5
    assert inert_keys(recipe_from_dict(r)) == []


@pytest.mark.llama_cpp
@pytest.mark.parametrize("mode, group", [("affine", 32), ("mxfp4", 32)])
def test_llama_cpp_reads_the_qat_gguf_with_the_qat_eval_loss(
    tmp_path, data_dir, llama_dir, mode, group
):
    """llama.cpp itself (llama-cpp-python) runs the GGUF of a QAT run: its held-out loss from
    llama.cpp's logits is the run's eval_loss (Q4_1: the scales and biases in fp16; MXFP4: the
    same codes exactly)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    r = qat_recipe(data_dir, llama_dir, formats=["gguf"], mode=mode, group_size=group)
    tr = build_run(r, tmp_path)
    tr.run()
    final = [x for x in run_rows(tmp_path / "run") if "eval_loss" in x][-1]["eval_loss"]
    path = next((tmp_path / "run" / "export" / "gguf").glob("*.gguf"))
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False)

    def forward(ids):
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])

    assert valid_loss(forward, list(tr.valid_set.examples)) == pytest.approx(final, rel=2e-3)


def test_a_learned_quantization_resumes_exactly(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(data_dir, llama_dir, checkpoints={"every": 1})
    del r["adapter"]
    r["objective"] = {
        "type": "distill",
        "teacher": str(llama_dir),
        "student_quantization": {"bits": 4, "group_size": 32},
    }
    r["optimizer"] = {"lr": 1e-4}
    r["train"]["log_every"] = 1
    build_run(r, tmp_path, "whole").run()
    cut = crash_and_resume(r, tmp_path, at=3)
    same_rows(run_rows(cut), run_rows(tmp_path / "whole"), rel=0, abs=0)


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_the_reference_policy_stays_in_full_precision(tmp_path, llama_dir, adapter):
    """DPO's reference (adapters off, or a copy of the starting weights) computes with the
    weights as they are, also inside a quantization-aware step."""
    prefs = write_splits(tmp_path / "prefs", pair_rows, 24, 8)
    r = qat_recipe(prefs, llama_dir, adapter=adapter)
    r["objective"] = {"type": "dpo", "beta": 0.1}
    t = build_run(r, tmp_path)
    obj = t.objective
    arrays = t.engine.arrays(next(obj.batches())[1])
    dense = np.array(obj.reference_logps(t.model, arrays))
    with qat.quantizing():
        inside = np.array(obj.reference_logps(t.model, arrays))
        policy = np.array(obj.sequence_logps(arrays))
    np.testing.assert_array_equal(inside, dense)
    assert np.abs(policy - dense).max() > 1e-4  # while the policy computes quantized
