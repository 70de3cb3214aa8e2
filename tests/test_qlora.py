"""QLoRA: quantizing the base at load (model.quantize), LoRA and DoRA over the quantized layers
against a dense model holding the de-quantized weights (values and gradients), the memory the
quantized weights take, models that are quantized already, and the recipe's checks."""

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import MINIMAL_RECIPE, load_minimal, peak_memory_mb, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.adapters import DoRALinear, LoRALinear, apply_adapters
from mlxtune.console import Console
from mlxtune.errors import UserInputError
from mlxtune.memory import Shape, alternatives, estimate, shape_of
from mlxtune.models import load_model, quantize_model, save_model

TOKENS = mx.array([[1, 5, 9, 12, 7, 3, 22, 4, 17, 8], [2, 30, 11, 6, 14, 9, 5, 40, 3, 1]])


def _dequantized(q: nn.Module) -> mx.array:
    return mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits)


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }


def _dense_twin(model_dir, quantized: nn.Module) -> nn.Module:
    """The same model with every quantized layer's de-quantized weights in plain layers."""
    dense, _ = load_model(model_dir)
    dense.load_weights(
        [(f"{name}.weight", _dequantized(q)) for name, q in _quantized_layers(quantized).items()],
        strict=False,
    )
    return dense


def _assert_close(a: mx.array, b: mx.array, tol: float = 1e-5):
    """Equal up to fp32 rounding: the largest difference within tol of the largest value."""
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= tol * np.abs(b).max(), (np.abs(a - b).max(), np.abs(b).max())


def _loss(model, emb):
    logits = model(TOKENS[:, :-1], None, input_embeddings=emb)
    return nn.losses.cross_entropy(logits, TOKENS[:, 1:], reduction="sum")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_model_packs_every_linear_and_the_embedding(llama_dir, bits):
    model, _ = load_model(llama_dir)
    dense_bytes = {
        name: 4 * m.weight.size
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding))
    }
    info = quantize_model(model, bits=bits, group_size=32)
    layers = _quantized_layers(model)
    assert set(layers) == set(dense_bytes)  # 2 blocks x 7 linears + the (tied) embedding
    assert info["layers"] == 15 and info["skipped"] == [] and info["already"] == 0
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    for name, q in layers.items():
        held = sum(v.nbytes for _, v in tree_flatten(q.parameters()))
        # bits per weight, plus an fp32 scale and bias per group of 32
        assert held / dense_bytes[name] == pytest.approx((bits / 8 + 8 / 32) / 4)
        if bits == 4:
            assert held < 0.35 * dense_bytes[name]
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert info["bytes_after"] == total < info["bytes_before"]


def test_layers_whose_input_is_not_a_multiple_of_the_group_stay_dense(llama_dir):
    model, _ = load_model(llama_dir)
    info = quantize_model(model, bits=4, group_size=64)  # hidden 32, intermediate 64
    dense = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
    expected = [
        f"model.layers.{i}.{'mlp' if n.startswith(('gate', 'up')) else 'self_attn'}.{n}"
        for i in range(2)
        for n in dense
    ]
    assert sorted(info["skipped"]) == sorted([*expected, "model.embed_tokens"])
    assert info["layers"] == 2  # the down projections (input 64)
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.Linear)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapters_over_the_quantized_base_match_the_dequantized_model(llama_dir, bits, kind):
    model, _ = load_model(llama_dir)
    quantize_model(model, bits=bits, group_size=32)
    dense = _dense_twin(llama_dir, model)
    mx.random.seed(4)
    apply_adapters(model, kind, 4, 8.0, 0.0, ["all-linear"])
    apply_adapters(dense, kind, 4, 8.0, 0.0, ["all-linear"])
    cls = DoRALinear if kind == "dora" else LoRALinear
    q_proj = model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, cls) and isinstance(q_proj.linear, nn.QuantizedLinear)
    # non-zero B (and a magnitude away from the base's norms), the same in both models
    trained = [
        (k, (mx.random.normal(v.shape) * 0.2 + (v if k.endswith(".m") else 0)))
        for k, v in tree_flatten(model.trainable_parameters())
    ]
    model.load_weights(trained, strict=False)
    dense.load_weights(trained, strict=False)
    if kind == "dora":  # DoRA's magnitude starts at the base's row norms: equal for both
        np.testing.assert_allclose(
            np.array(q_proj.m), np.array(dense.layers[1].self_attn.q_proj.m), rtol=1e-6
        )
    emb = dense.model.embed_tokens(TOKENS[:, :-1])

    def grads(m):
        fn = nn.value_and_grad(m, lambda mm, e: _loss(mm, e))
        (loss, g_params), g_emb = (
            fn(m, emb),
            mx.grad(lambda e: _loss(m, e))(emb),
        )
        return loss, dict(tree_flatten(g_params)), g_emb

    loss_q, g_q, e_q = grads(model)
    loss_d, g_d, e_d = grads(dense)
    assert loss_q.item() == pytest.approx(loss_d.item(), rel=1e-5)
    assert set(g_q) == set(g_d) and all(k.endswith(("lora_a", "lora_b", ".m")) for k in g_q)
    for k in g_q:
        _assert_close(g_q[k], g_d[k])
    _assert_close(e_q, e_d)
    assert max(float(mx.abs(g).max()) for g in g_q.values()) > 1e-3  # the gradients are real


@pytest.mark.parametrize("bits", [4, 8])
def test_lora_layer_over_quantized_linear_values_and_input_gradient(bits):
    mx.random.seed(5)
    q = nn.QuantizedLinear.from_linear(nn.Linear(64, 48, bias=False), group_size=32, bits=bits)
    layer = LoRALinear.from_base(q, rank=4, alpha=8.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    ref = nn.Linear(64, 48, bias=False)
    ref.weight = _dequantized(q)
    x = mx.random.normal((3, 7, 64))

    def ours(x, a, b):
        layer.lora_a, layer.lora_b = a, b
        return (layer(x) ** 2).sum()

    def naive(x, a, b):
        return ((ref(x) + layer.scale * (x @ a) @ b) ** 2).sum()

    args = (x, layer.lora_a, layer.lora_b)
    assert ours(*args).item() == pytest.approx(naive(*args).item(), rel=1e-5)
    for g1, g2 in zip(
        mx.grad(ours, argnums=(0, 1, 2))(*args),
        mx.grad(naive, argnums=(0, 1, 2))(*args),
        strict=True,
    ):
        _assert_close(g1, g2)


def test_a_model_saved_quantized_loads_quantized_and_trains(tmp_path, llama_dir, tokenizer):
    model, config = load_model(llama_dir)
    quantize_model(model, bits=4, group_size=32)
    out = tmp_path / "q4"
    save_model(model, {**config, "quantization": {"group_size": 32, "bits": 4}}, out, tokenizer)
    loaded, cfg = load_model(out)
    assert cfg["quantization"] == {"group_size": 32, "bits": 4}
    assert set(_quantized_layers(loaded)) == set(_quantized_layers(model))
    np.testing.assert_array_equal(np.array(loaded(TOKENS)), np.array(model(TOKENS)))
    info = quantize_model(loaded, bits=4, group_size=32)  # nothing left to quantize
    assert info["layers"] == 0 and info["already"] == 15
    apply_adapters(loaded, "lora", 4, 8.0, 0.0, ["q_proj", "v_proj"])
    assert isinstance(loaded.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    emb = loaded.model.embed_tokens(TOKENS[:, :-1])
    loss, grads = nn.value_and_grad(loaded, lambda m: _loss(m, emb))(loaded)
    flat = dict(tree_flatten(grads))
    assert len(flat) == 8 and np.isfinite(loss.item())
    assert float(mx.abs(flat["model.layers.0.self_attn.q_proj.lora_b"]).max()) > 0


@pytest.mark.parametrize("loss", ["chunked", "reference"])
def test_memory_shape_counts_the_packed_weights(loss, tmp_path, data_dir, llama_dir):
    recipe = tiny_recipe(data_dir, llama_dir)
    recipe["kernels"] = {**recipe.get("kernels", {}), "loss": loss}
    tr = Trainer(recipe_from_dict(recipe), tmp_path / "r", console=Console(True))
    dense = shape_of(tr)
    # the tiny llama in fp32, counted from its shapes: hidden 32, 2 blocks, intermediate 64,
    # 4 heads of 8 (q and o 32x32), 2 kv heads (k and v 16x32), LoRA rank 4 on q and v, and
    # the tied 60 x 32 embedding
    block = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32 + 2 * 32 + (32 * 4 + 4 * 32) + (32 * 4 + 4 * 16)
    assert len(tr.tokenizer._tokenizer) == 60
    assert dense.weight_bytes == 4 * (60 * 32 + 2 * block + 32)
    quantize_model(tr.model, bits=4, group_size=32)  # the LoRA bases and the embedding
    assert isinstance(tr.model.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    shape = shape_of(tr)
    packed = sum(v.nbytes for _, v in tree_flatten(tr.model.parameters()))
    head = tr.model.model.embed_tokens
    assert head.scales.shape[0] == 60
    # the chunked loss de-quantizes a chunk of the tied head's rows at a time; the reference
    # loss the whole 60 x 32 head in fp32, which on the CPU peaks at twice that
    dense_head = 0 if loss == "chunked" else 2 * 60 * 32 * 4
    assert shape.weight_bytes == packed + dense_head
    assert packed < 0.35 * dense.weight_bytes
    assert shape.quantizable == 0  # quantized already
    assert dense.quantizable == 2 * 32 * 64  # the down projections: input 64, one group
    assert shape.trainable == dense.trainable


def _shape(**over) -> Shape:
    s = dict(
        weight_bytes=4 * 10**9,
        trainable=10**7,
        trainable_bytes=4 * 10**7,
        trainable_16bit=0,
        full=False,
        act_bytes=4,
        layers=16,
        hidden=2048,
        intermediate=8192,
        q_dim=2048,
        kv_dim=1024,
        heads=16,
        vocab=32000,
        batch=1,
        length=512,
        accumulation=1,
        optimizer_bytes=2 * 4 * 10**7,
        masters=False,
        attention_scores=False,
        logits_full=False,
        logit_chunk=1 << 20,
        quantizable=10**9,
    )
    s.update(over)
    return Shape(**s)


def test_memory_alternatives_suggest_quantizing_a_lora_base(data_dir, llama_dir):
    s = _shape()
    parts = estimate(s)
    budget = parts["total"] - 0.5 * parts["weights"]  # fits only with far smaller weights
    lora = recipe_from_dict(tiny_recipe(data_dir, llama_dir))
    out = alternatives(s, budget, lora)
    assert any(o.startswith("model.quantize: {bits: 4, group_size: 64}") for o in out), out
    # 4 bits and an fp32 scale and bias per 64 weights: 0.156x of fp32
    q = estimate(_shape(weight_bytes=int(10**9 * (0.5 + 8 / 64))))["total"]
    assert f"(about {q / 1e9:.2f} GB)" in next(o for o in out if o.startswith("model.quantize"))
    # not for a base that is quantized already (nothing quantizable), nor full fine-tuning
    assert not any("model.quantize" in o for o in alternatives(_shape(quantizable=0), budget, lora))
    full = recipe_from_dict(tiny_recipe(data_dir, llama_dir, adapter={"type": "full"}))
    full_shape = dataclasses.replace(s, full=True)  # a full fine-tune's shape, as shape_of gives
    assert not any("model.quantize" in o for o in alternatives(full_shape, budget, full))


def _load(tmp_path, overrides):
    return load_minimal(tmp_path, overrides)


def test_recipe_quantize_settings(tmp_path):
    assert _load(tmp_path, []).model.quantize is None
    q = _load(tmp_path, ["model.quantize={bits: 8, group_size: 32}"]).model.quantize
    assert (q.bits, q.group_size) == (8, 32)
    q = _load(tmp_path, ["model.quantize={}"]).model.quantize
    assert (q.bits, q.group_size) == (4, 64)
    r = _load(tmp_path, ["model.quantize={bits: 4}", "adapter.type=dora"])
    assert r.to_dict()["model"]["quantize"] == {"bits": 4, "group_size": 64}


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["model.quantize={bits: 3}"], "model.quantize.bits", "not one of 4, 8"),
        (["model.quantize={bits: 4.0}"], "model.quantize.bits", "expected an integer"),
        (["model.quantize={group_size: 48}"], "model.quantize.group_size", "not one of 32, 64"),
        (["model.quantize={bitz: 4}"], "model.quantize.bitz", "did you mean 'bits'"),
        (["model.quantize=4"], "model.quantize", "expected a mapping"),
        (["model.quantize={}", "adapter.type=full"], "model.quantize", "lora or dora"),
        (
            ["model.quantize={}", "model.path=null", "model.arch={model_type: llama}"],
            "model.quantize",
            "model built from arch",
        ),
    ],
)
def test_recipe_refuses_bad_quantize_settings_naming_the_key(tmp_path, overrides, key, words):
    with pytest.raises(UserInputError) as e:
        _load(tmp_path, overrides)
    assert f"{key}:" in str(e.value) and words in str(e.value)


def test_cli_exits_2_naming_the_key(tmp_path, capsys):
    from mlxtune.cli import main

    p = tmp_path / "r.yaml"
    p.write_text(
        MINIMAL_RECIPE.replace("  path: some/model\n", "  path: m\n  quantize: {bits: 4}\n")
    )
    (tmp_path / "train.jsonl").write_text('{"text": "a b"}\n')
    assert main(["validate", str(p), "adapter.type=full"]) == 2
    err = capsys.readouterr().err
    assert "model.quantize" in err and "Traceback" not in err


def test_a_qlora_run_trains(tmp_path, data_dir, llama_dir):
    import json

    r = tiny_recipe(data_dir, llama_dir, eval={"every": None})
    r["model"]["quantize"] = {"bits": 4, "group_size": 32}
    r["adapter"].update(type="dora", targets=["all-linear"])
    r["train"].update(log_every=1, max_steps=8)
    tr = Trainer(recipe_from_dict(r), tmp_path / "q", console=Console(quiet=True))
    if not _quantized_layers(tr.model):  # until the trainer quantizes the base itself
        quantize_model(tr.model, bits=4, group_size=32)
    assert isinstance(tr.model.layers[0].mlp.down_proj.linear, nn.QuantizedLinear)
    tr.run()
    rows = [json.loads(x) for x in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in rows if "grad_norm" in x]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    trainable = [k for k, _ in tree_flatten(tr.model.trainable_parameters())]
    assert all(k.endswith(("lora_a", "lora_b", ".m")) for k in trainable)


# MLX's own product; the de-quantizing one, whole and a block of 40 output rows at a time
@pytest.mark.parametrize("rows,block", [(3, None), (200, None), (200, 40 * 128)])
def test_the_cpus_quantized_layers_give_the_de_quantized_product_either_way(
    rows, block, monkeypatch
):
    """On the CPU a quantized layer multiplies by its de-quantized weight through BLAS, except
    over a few rows (MLX's own product); a large weight goes a block of output rows at a time:
    the same values and input gradients as NumPy over the de-quantized weight, every way."""
    from mlxtune.models import quantize
    from mlxtune.models.quantize import DequantizingEmbedding, DequantizingLinear

    if block is not None:
        monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", block)
        monkeypatch.setattr(quantize, "BLOCK_ELEMENTS", block)
        assert len(quantize._row_blocks(96, 128)) == 3  # 40, 40 and 16 rows

    lin = nn.QuantizedLinear(128, 96, bias=False, group_size=64, bits=4)
    emb = nn.QuantizedEmbedding(96, 128, group_size=64, bits=4)
    lin.__class__, emb.__class__ = DequantizingLinear, DequantizingEmbedding
    x = mx.random.normal((rows, 128), key=mx.random.key(rows))
    g = mx.random.normal((rows, 96), key=mx.random.key(rows + 1))
    for layer, call in ((lin, lin.__call__), (emb, emb.as_linear)):
        w = np.array(
            mx.dequantize(layer.weight, layer.scales, layer.biases, 64, 4), dtype=np.float64
        )
        y, dx = mx.vjp(call, [x], [g])
        np.testing.assert_allclose(
            np.array(y[0]), np.array(x, np.float64) @ w.T, rtol=1e-4, atol=1e-4
        )
        np.testing.assert_allclose(
            np.array(dx[0]), np.array(g, np.float64) @ w, rtol=1e-4, atol=1e-4
        )


def test_many_rows_through_a_large_quantized_head_hold_a_block_of_it_dense(monkeypatch):
    """A prefill's product with a 64k x 1024 head (256 MB dense in fp32, twice that while MLX
    de-quantizes it on the CPU) holds a block of 4M weights (16 MB) at a time, forward and
    backward, beside its own output (16 MB for 64 rows)."""
    from mlxtune.models import quantize
    from mlxtune.models.quantize import DequantizingLinear

    monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", 1 << 22)
    head = nn.QuantizedLinear(1024, 1 << 16, bias=False, group_size=64, bits=4)
    head.__class__ = DequantizingLinear
    mx.eval(head.parameters())
    x = mx.random.normal((64, 1024))
    g = mx.random.normal((64, 1 << 16))
    mx.eval(x, g)
    assert peak_memory_mb(head, x) < 128
    assert peak_memory_mb(lambda x: mx.vjp(head, [x], [g])[1][0], x) < 128
    monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", 1 << 30)  # whole: the test can fail
    assert peak_memory_mb(head, x) > 256


def test_a_few_rows_through_a_large_quantized_head_never_hold_it_dense():
    """A probe's or a generated token's product with a 64k x 1024 tied head (256 MB dense in
    fp32) holds a few MB, not the dense head (twice over while MLX de-quantizes it)."""
    from mlxtune.models.quantize import DequantizingEmbedding

    emb = nn.QuantizedEmbedding(1 << 16, 1024, group_size=64, bits=4)
    emb.__class__ = DequantizingEmbedding
    mx.eval(emb.parameters())
    x = mx.random.normal((1, 6, 1024))
    mx.eval(x)
    assert peak_memory_mb(emb.as_linear, x) < 32


def test_an_export_de_quantizes_a_large_head_a_block_of_rows_at_a_time(monkeypatch):
    """A fused export to a narrower dtype de-quantizes a weight of more than WHOLE_ELEMENTS (an
    LM head) a block of rows at a time, cast to the export's dtype block by block: the same values as
    MLX's whole de-quantization, and a 64k x 1024 head (256 MB in fp32, twice that while MLX
    de-quantizes it whole on the CPU) written in bf16 without ever holding it in fp32."""
    from mlxtune.export.fused import dequantize
    from mlxtune.models import quantize

    monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", 1 << 22)
    head = nn.QuantizedLinear(1024, 1 << 16, bias=False, group_size=64, bits=4)
    small = nn.QuantizedLinear(1024, 64, bias=True, group_size=64, bits=4)
    mx.eval(head.parameters(), small.parameters())
    model = nn.Module()
    model.head, model.small = head, small
    whole = np.array(mx.dequantize(head.weight, head.scales, head.biases, 64, 4))

    dense, config = dequantize(model, {"quantization": {"bits": 4}}, "bfloat16")
    assert "quantization" not in config
    assert isinstance(dense.head, nn.Linear) and isinstance(dense.small, nn.Linear)
    assert dense.head.weight.dtype == mx.bfloat16
    got = np.array(dense.head.weight.astype(mx.float32))
    want = np.array(mx.array(whole).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(  # the rest de-quantized whole, then cast
        np.array(dense.small.weight.astype(mx.float32)),
        np.array(
            mx.dequantize(small.weight, small.scales, small.biases, 64, 4)
            .astype(mx.bfloat16)
            .astype(mx.float32)
        ),
    )

    def exported():  # the head's weight as an export writes it (dequantize replaces layers)
        holder = nn.Module()
        holder.head = head
        return dequantize(holder, {}, "bfloat16")[0].head.weight

    # the bf16 head (134 MB) and its blocks before they are joined; never 256 MB in fp32
    assert peak_memory_mb(exported) < 420  # measured 336 MB
    monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", 1 << 30)  # whole: the test can fail
    assert peak_memory_mb(exported) > 500  # measured 537 MB


def test_an_export_writes_a_large_head_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """Given the blocks (``dequantize``'s ``rows``), the safetensors writer computes, writes and
    drops the head a block at a time: it never holds the head whole, and writes MLX's whole
    de-quantization, cast, byte for byte."""
    from mlxtune.export.fused import dequantize
    from mlxtune.models import quantize
    from mlxtune.models.building import write_safetensors

    monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", 1 << 22)
    head = nn.QuantizedLinear(1024, 1 << 16, bias=False, group_size=64, bits=4)
    mx.eval(head.parameters())
    want = np.array(
        mx.dequantize(head.weight, head.scales, head.biases, 64, 4)
        .astype(mx.bfloat16)
        .astype(mx.float32)
    )

    def written(name: str, by_blocks: bool) -> int:
        holder = nn.Module()
        holder.head = head
        rows: dict = {}
        dense, _ = dequantize(holder, {}, "bfloat16", rows=rows)
        weights = {"head.weight": dense.head.weight}
        del dense, holder  # (de-quantized in place) the weights dict holds the head alone
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        write_safetensors(tmp_path / name, weights, None, rows if by_blocks else None)
        assert weights == {}
        return mx.get_peak_memory() - base

    peak = written("blocks.safetensors", True)
    assert peak < 64 * 2**20, peak  # the bf16 head alone is 128 MiB
    got = mx.load(str(tmp_path / "blocks.safetensors"))["head.weight"]
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    assert written("joined.safetensors", False) > 2 * 128 * 2**20  # joined: the test can fail


def test_a_gguf_export_reads_a_large_head_a_block_of_rows_at_a_time(monkeypatch):
    """The GGUF writer fills a head ``dequantize`` holds as blocks of rows into its fp32 array a
    block at a time: MLX never holds it whole, and the values are MLX's whole de-quantization."""
    from mlxtune.export.fused import dequantize
    from mlxtune.export.gguf.write import _as_numpy
    from mlxtune.models import quantize

    monkeypatch.setattr(quantize, "WHOLE_ELEMENTS", 1 << 22)
    head = nn.QuantizedLinear(1024, 1 << 16, bias=False, group_size=64, bits=4)
    mx.eval(head.parameters())
    want = np.array(mx.dequantize(head.weight, head.scales, head.biases, 64, 4))

    def read(by_blocks: bool):
        holder = nn.Module()
        holder.head = head
        rows: dict = {}
        dense, _ = dequantize(holder, {}, rows=rows)
        tensors = [("head.weight", dense.head.weight)]
        del dense, holder
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        got = _as_numpy(tensors, 0, rows if by_blocks else None)
        assert tensors == [None] and rows == ({} if by_blocks else rows)
        return got, mx.get_peak_memory() - base

    got, peak = read(True)
    np.testing.assert_array_equal(got, want)
    assert peak < 64 * 2**20, peak  # the fp32 head alone is 256 MiB
    assert read(False)[1] > 256 * 2**20  # joined: the test can fail
