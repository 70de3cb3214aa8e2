"""Big models without big memory: a QLoRA base read and quantized a layer at a time, fused and
GGUF exports that compute one shard or one weight at a time (never the whole model in full
precision), sharded safetensors as transformers and mlx-lm read them, and each stage's time and
peak in summary.json.

Memory is MLX's own count (``mx.get_peak_memory``) around the call, against the bytes of the
whole model in full precision: what the stage held before this was built."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import build_run, shake_adapters, smollm2_gguf, tiny_arch, tiny_recipe
from mlxtune.adapters import adapt_model
from mlxtune.export import TrainedModel, adapter_modules, dequantize, export, fuse
from mlxtune.models import (
    build_model,
    load_model,
    quantize_model,
    save_model,
    shadow,
)

LAYERS = 8
SIZES = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": LAYERS}


def dense_bytes(model) -> int:
    """The model's weights in float32, de-quantized and merged: what an export used to hold."""
    m, _ = dequantize(fuse(shadow(model)), {})
    return sum(v.size * 4 for _, v in tree_flatten(m.parameters()))


def peak_during(fn, *args):
    """(fn's value, MLX's peak above what was held before it ran)."""
    mx.eval([v for _, v in tree_flatten(args[0].model.parameters())] if args else [])
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = fn(*args)
    return out, mx.get_peak_memory() - base


@pytest.fixture
def trained(tokenizer, tokenizer_dir):
    """A llama of eight layers over a 4-bit base, LoRA on every linear layer, its adapters moved
    off zero (so the merge changes every adapted weight)."""
    model, config = build_model(tiny_arch("llama", **SIZES), len(tokenizer._tokenizer), seed=1)
    quantize_model(model, 4, 64)
    info = adapt_model(model, "lora", 8, 16, 0.0, ["all-linear"], None, False)
    shake_adapters(model)
    mx.eval(model.parameters())
    adapter = {"type": "lora", "rank": 8, "alpha": 16, **info}
    return TrainedModel(model, tokenizer, config, adapter, None, tokenizer_dir)


def test_a_fused_export_holds_one_shard_not_the_model(tmp_path, trained, monkeypatch):
    from mlxtune.models import building

    whole = dense_bytes(trained.model)
    monkeypatch.setattr(building, "SHARD_BYTES", whole // 8)  # about one layer a shard
    _, peak = peak_during(lambda t: export(t, "fused", tmp_path), trained)
    assert peak < 0.4 * whole, (peak, whole)
    # the shards, as transformers and mlx-lm find them, hold exactly the merged model
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(files) > 4 and sorted(set(index["weight_map"].values())) == files
    written = {}
    for f in files:
        written.update(mx.load(str(tmp_path / f)))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in written.values())
    merged, _ = dequantize(fuse(shadow(trained.model)), {})
    want = dict(tree_flatten(merged.parameters()))
    assert written.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(np.array(written[k]), np.array(v), rtol=1e-6, atol=1e-6)
    # the trained model is as it was: the merge was done on a copy
    assert len(adapter_modules(trained.model)) == len(trained.adapter["adapted"])
    back, _ = load_model(tmp_path)
    x = mx.array([[1, 5, 9, 2]])
    np.testing.assert_allclose(np.array(back(x)), np.array(trained.model(x)), atol=2e-4)


def test_a_gguf_export_computes_one_weight_at_a_time(tmp_path, trained):
    import gguf

    whole = dense_bytes(trained.model)
    _, peak = peak_during(lambda t: export(t, "gguf", tmp_path, "f32"), trained)
    assert peak < 0.4 * whole, (peak, whole)
    r = gguf.GGUFReader(next(tmp_path.glob("*.gguf")))
    merged, _ = dequantize(fuse(shadow(trained.model)), {})
    embed = np.array(merged.model.embed_tokens.weight)
    got = {t.name: t for t in r.tensors}
    np.testing.assert_allclose(np.asarray(got["token_embd.weight"].data), embed, atol=1e-6)
    down = np.array(merged.model.layers[3].mlp.down_proj.weight)
    np.testing.assert_allclose(np.asarray(got["blk.3.ffn_down.weight"].data), down, atol=1e-6)
    assert not list(tmp_path.glob("tmp*"))  # the tensors' temporary file went with the writer
    assert len(adapter_modules(trained.model)) == len(trained.adapter["adapted"])


def test_a_dense_base_is_quantized_as_it_is_read(tmp_path, tokenizer, tokenizer_dir):
    model, config = build_model(tiny_arch("llama", **SIZES), len(tokenizer._tokenizer), seed=2)
    save_model(model, config, tmp_path, tokenizer, tokenizer_dir)
    whole = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    want = quantize_model(model, 4, 64)
    x = mx.array([[3, 1, 4, 1, 5]])
    expected = np.array(model(x))
    del model
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    lazy, _ = load_model(tmp_path, "float32", lazy=True)
    got = quantize_model(lazy, 4, 64)
    assert mx.get_peak_memory() - base < 0.6 * whole  # never the dense model whole
    assert got["layers"] == want["layers"]
    np.testing.assert_allclose(np.array(lazy(x)), expected, atol=1e-5)


def test_a_saved_model_over_the_shard_size_is_sharded_and_reads_back(
    tmp_path, tokenizer, tokenizer_dir, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from mlxtune.models import building

    model, config = build_model(tiny_arch("llama"), len(tokenizer._tokenizer), seed=4)
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    monkeypatch.setattr(building, "SHARD_BYTES", total // 3)
    save_model(model, config, tmp_path, tokenizer, tokenizer_dir)
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3
    ids = [[2, 7, 1, 8, 2]]
    want = np.array(model(mx.array(ids)))
    back, _ = load_model(tmp_path)
    np.testing.assert_allclose(np.array(back(mx.array(ids))), want, atol=1e-5)
    import torch

    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        out = theirs(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(out, want, atol=1e-4)


def test_smollm2s_pre_tokenizer_exports_under_its_own_llama_cpp_name(tmp_path):
    """SmolLM2's tokenizer (digits split one by one, then GPT-2's pieces), as read from its
    GGUF, goes back to GGUF with the name the file itself gives it."""
    from mlxtune.export.gguf.vocab import _bpe_pre_name
    from mlxtune.gguf.file import open_gguf
    from mlxtune.gguf.tokenizer import write_tokenizer_from_gguf

    path = smollm2_gguf()
    write_tokenizer_from_gguf(path, tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert _bpe_pre_name(data) == open_gguf(path).fields["tokenizer.ggml.pre"] == "smollm"


def test_each_stage_is_timed_and_its_peak_logged(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(
        data_dir, llama_dir, export={"formats": ["mlx-lm", "fused"]},
        checkpoints={"every": 3},
    )  # fmt: skip
    summary = build_run(r, tmp_path).run()
    stages = json.loads((tmp_path / "run" / "summary.json").read_text())["stages"]
    assert summary["stages"] == stages
    assert {"load", "checkpoint", "export/mlx-lm", "export/fused"} <= stages.keys()
    for record in stages.values():
        assert record["seconds"] >= 0 and record["peak_resident_gb"] > 0
    assert all(isinstance(record["raised_peak"], bool) for record in stages.values())
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "model, tokenizer and data loaded:" in log and "exported fused to" in log
    assert "GB resident" in log


def test_safetensors_are_written_a_tensor_at_a_time_as_other_readers_read_them(tmp_path):
    import torch
    from safetensors.torch import load_file

    from mlxtune.models.building import write_safetensors

    rng = np.random.default_rng(0)
    want = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4,)).astype(np.float16),
        "i64": rng.integers(-9, 9, (2, 3)).astype(np.int64),
        "u32": rng.integers(0, 2**32 - 1, (5,), dtype=np.uint32),
        "u8": rng.integers(0, 255, (7,), dtype=np.uint8),
        "flag": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    tensors = {k: mx.array(v) for k, v in want.items()}
    bf16 = rng.standard_normal((6, 2)).astype(np.float32)
    tensors["bf16"] = mx.array(bf16).astype(mx.bfloat16)
    tensors["transposed"] = mx.array(want["f32"]).T  # not row-major as held
    written = write_safetensors(tmp_path / "w.safetensors", tensors, {"format": "mlx"})
    assert tensors == {}  # each taken out as it was written
    theirs = load_file(tmp_path / "w.safetensors")  # safetensors' own reader
    for k, v in want.items():
        np.testing.assert_array_equal(theirs[k].numpy(), v)
    np.testing.assert_array_equal(theirs["transposed"].numpy(), want["f32"].T)
    ref = torch.tensor(bf16).to(torch.bfloat16)  # torch's rounding to bf16, not MLX's
    assert torch.equal(theirs["bf16"], ref)
    assert written == sum(t.numel() * t.element_size() for t in theirs.values())
    ours = mx.load(str(tmp_path / "w.safetensors"))
    np.testing.assert_array_equal(np.array(ours["u32"]), want["u32"])


def _quantized_base(path, tokenizer, tokenizer_dir, layers: int):
    """A 4-bit llama folder as mlx-community writes one (codes, scales, biases)."""
    sizes = {**SIZES, "num_hidden_layers": layers}
    model, config = build_model(tiny_arch("llama", **sizes), len(tokenizer._tokenizer), seed=5)
    quantize_model(model, 4, 64)
    config = {**config, "quantization": {"group_size": 64, "bits": 4}}
    save_model(model, config, path, tokenizer, tokenizer_dir)
    return path


def test_an_export_command_reads_the_base_as_it_writes(
    tmp_path, data_dir, tokenizer, tokenizer_dir
):
    """``mlxtune export`` reads the base lazily and drops each weight once its output is
    written: it holds a weight or two, not the model; the files equal an export from the
    model held whole, and a 4-bit export keeps the codes of every layer it did not adapt."""
    from mlxtune.runs.checkpoint import find_checkpoint, load_checkpoint

    base = _quantized_base(tmp_path / "base", tokenizer, tokenizer_dir, 16)
    adapter = {"type": "lora", "rank": 8, "alpha": 16, "targets": ["all-linear"]}
    r = tiny_recipe(data_dir, base, adapter=adapter, eval={"every": None})
    r["train"] = {**r["train"], "max_steps": 2, "batch_size": 2}
    build_run(r, tmp_path).run()
    ckpt = find_checkpoint(tmp_path / "run")

    held = load_checkpoint(ckpt)
    mx.eval(held.model.parameters())
    whole = sum(v.nbytes for _, v in tree_flatten(held.model.parameters()))
    export(held, "fused", tmp_path / "held", "bfloat16")
    del held
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    lazy = load_checkpoint(ckpt, lazy=True)
    export(lazy, "fused", tmp_path / "lazy", "bfloat16", consume=True)
    # one weight and its temporaries (held whole, the model alone is `whole`)
    assert mx.get_peak_memory() - before < 0.4 * whole, (mx.get_peak_memory() - before, whole)
    assert sum(v.size for _, v in tree_flatten(lazy.model.parameters())) == 0  # consumed
    a = mx.load(str(tmp_path / "held" / "model.safetensors"))
    b = mx.load(str(tmp_path / "lazy" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)

    q = load_checkpoint(ckpt, lazy=True)
    export(q, "fused", tmp_path / "q4", quantize=4, group_size=64, consume=True)
    codes = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    src = mx.load(str(base / "model.safetensors"))
    assert "lm_head.weight" not in src  # tied: the embedding is the head
    for k in (
        "model.embed_tokens.weight",
        "model.embed_tokens.scales",
        "model.embed_tokens.biases",
    ):
        np.testing.assert_array_equal(np.array(codes[k]), np.array(src[k]))
    # an adapted layer is merged, then quantized: its de-quantized weight is the merged one's
    name = "model.layers.3.mlp.down_proj"
    merged = np.array(a[f"{name}.weight"].astype(mx.float32))
    got = mx.dequantize(codes[f"{name}.weight"], codes[f"{name}.scales"], codes[f"{name}.biases"])
    assert not np.array_equal(np.array(codes[f"{name}.weight"]), np.array(src[f"{name}.weight"]))
    step = np.abs(merged).max() / 7
    assert np.abs(np.array(got) - merged).max() < step
