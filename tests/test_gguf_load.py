"""GGUF files as a base model: read back into the same model for every family mlxtune exports,
quantized tensors (Q8_0, Q4_0, Q4_1) held as MLX quantized layers without rounding, other types
de-quantized, and what cannot be read refused by name.

References: the model that was exported (its own logits), and the numpy forward pass of
test_gguf.py, which follows llama.cpp's conventions on the file's tensors as the ``gguf``
package de-quantizes them."""

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_gguf import llama_cpp_forward, read

from mlxtune.errors import UserInputError
from mlxtune.export.gguf.write import write_gguf_model
from mlxtune.models import gguf_config, load_gguf, load_model, read_gguf

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"]
IDS = [1, 5, 9, 13, 2, 7, 30, 41, 3, 17, 22, 8]


def logits(model, ids=IDS):
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def export(model_dir, tokenizer, tokenizer_dir, out, dtype="f32"):
    model, config = load_model(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    return model, config, write_gguf_model(model, config, tokenizer, tokenizer_dir, out, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reads_back_from_its_own_gguf_export(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir, family
):
    model, config, path = export(model_dir_factory(family), tokenizer, tokenizer_dir, tmp_path)
    loaded, cfg = load_model(path)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        assert cfg[key] == config[key], key
    # mistral's GGUF architecture is llama's; mlx-lm runs both with the same module
    assert cfg["model_type"] == ("llama" if family == "mistral" else family)
    assert cfg["tie_word_embeddings"] == config.get("tie_word_embeddings", True)
    want = logits(model)
    np.testing.assert_allclose(logits(loaded), want, atol=1e-5 * np.abs(want).max())


def copy_with_types(src, dst, kind_for, drop=()):
    """Write ``src``'s metadata and tensors into ``dst``, each 2-D tensor stored as
    ``kind_for(name, shape)`` (quantized by the gguf package's reference code), the tensors
    named in ``drop`` left out."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = f.contents(), f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value) if f.types[-1] != gguf.GGUFValueType.INT32 else w.add_key_value(
                key, value, vtype, sub_type=f.types[-1]
            )
        else:
            w.add_key_value(key, value, vtype)
    for t in (t for t in r.tensors if t.name not in drop):
        a = np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        kind = kind_for(t.name, a.shape) if a.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, a)
        else:
            w.add_tensor(t.name, gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_tied_head_left_out_of_the_file_is_tied(tmp_path, tokenizer, tokenizer_dir):
    """llama.cpp's converter writes no output.weight for a tied head. Gemma 3's text model
    holds a head of its own unless its checkpoint has none (mlx-lm's sanitize ties it then): a
    file without output.weight loads with the head tied to the embedding, the same logits."""
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model, save_model

    config = {  # what llama.cpp's gemma3 fixes
        **tiny_config("gemma3_text", 64),
        "num_hidden_layers": 6,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 16,
        "head_dim": 16,
    }
    model, config = build_model(config, 64, seed=2)
    model.lm_head.weight = model.model.embed_tokens.weight  # what a tied checkpoint holds
    folder = save_model(model, config, tmp_path / "hf", tokenizer, tokenizer_dir)[0]
    _, _, path = export(folder, tokenizer, tokenizer_dir, tmp_path / "gguf")
    assert "output.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    f32 = gguf.GGMLQuantizationType.F32
    tied = copy_with_types(path, tmp_path / "tied.gguf", lambda *_: f32, drop={"output.weight"})
    loaded, cfg = load_model(tied)
    assert cfg["tie_word_embeddings"]
    head_owner = getattr(loaded, "language_model", loaded)
    assert head_owner.tie_word_embeddings and "lm_head" not in head_owner
    want = logits(model)
    np.testing.assert_allclose(logits(loaded), want, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(
    "family, kind",
    [
        # suite time: qwen3's Q4_0 stays in the default run; Q8_0 layers are also read exactly
        # in tests/test_gguf_run.py
        pytest.param("llama", "Q4_1", marks=pytest.mark.slow),
        pytest.param("llama", "Q8_0", marks=pytest.mark.slow),
        ("qwen3", "Q4_0"),
    ],
)
def test_native_quantized_types_load_as_mlx_quantized_layers_exactly(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir, kind, family
):
    _, _, f32 = export(model_dir_factory(family), tokenizer, tokenizer_dir, tmp_path / "f32")
    q = getattr(gguf.GGMLQuantizationType, kind)
    path = copy_with_types(f32, tmp_path / f"{kind}.gguf", lambda name, shape: q)
    f, t, _ = read(path)  # the gguf package's de-quantization: the reference
    want = llama_cpp_forward(f, t, IDS)
    kept, _, done = load_gguf(path, keep_quantized=True)
    dense, _, done_dense = load_gguf(path, keep_quantized=False)
    layers = [m for _, m in kept.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(layers) == 7 * 2  # q, k, v, o, gate, up, down in each of 2 blocks
    assert all(m.group_size == 32 and m.bits == (8 if kind == "Q8_0" else 4) for m in layers)
    assert isinstance(kept.model.embed_tokens, nn.QuantizedEmbedding)  # the tied head too
    assert len(done.quantized) == 15 and not done.dequantized
    assert not done_dense.quantized and len(done_dense.dequantized) == 15
    assert done.nbytes < done_dense.nbytes / 2
    for model in (kept, dense):
        np.testing.assert_allclose(logits(model), want, atol=2e-5 * np.abs(want).max())


def test_other_types_are_dequantized_to_the_model_dtype(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir
):
    _, _, f32 = export(model_dir_factory("llama"), tokenizer, tokenizer_dir, tmp_path / "f32")
    kinds = {"attn_q": "F16", "attn_k": "BF16", "ffn_up": "Q5_0", "ffn_down": "Q4_1"}

    def kind_for(name, shape):
        for part, k in kinds.items():
            if f".{part}." in name:
                return getattr(gguf.GGMLQuantizationType, k)
        return gguf.GGMLQuantizationType.F32

    path = copy_with_types(f32, tmp_path / "mixed.gguf", kind_for)
    f, t, _ = read(path)
    want = llama_cpp_forward(f, t, IDS)
    model, _, done = load_gguf(path, keep_quantized=True)
    assert set(done.dequantized.values()) == {"F16", "BF16", "Q5_0"}
    assert set(done.quantized.values()) == {4}  # Q4_1 stays quantized
    assert isinstance(model.layers[0].mlp.up_proj, nn.Linear)
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    np.testing.assert_allclose(logits(model), want, atol=2e-5 * np.abs(want).max())
    bf, _, _ = load_gguf(path, dtype="bfloat16", keep_quantized=False)
    assert all(v.dtype == mx.bfloat16 for _, v in nn.utils.tree_flatten(bf.parameters()))


def test_config_comes_from_the_metadata(tmp_path, model_dir_factory, tokenizer, tokenizer_dir):
    _, config, path = export(model_dir_factory("gemma2"), tokenizer, tokenizer_dir, tmp_path)
    cfg = gguf_config(read_gguf(path))
    f = read(path)[0]
    assert cfg["head_dim"] == f["gemma2.attention.key_length"] == config["head_dim"]
    assert cfg["final_logit_softcapping"] == f["gemma2.final_logit_softcapping"]
    assert cfg["query_pre_attn_scalar"] == config["query_pre_attn_scalar"]
    assert cfg["bos_token_id"] == f["tokenizer.ggml.bos_token_id"]


def write_minimal(path, arch="llama", extra=(), tensors=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_context_length(64)
    for key, value in extra:
        w.add_key_value(key, value, gguf.GGUFValueType.STRING)
    for name, a in (tensors or {"token_embd.weight": np.zeros((10, 32), np.float32)}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_what_cannot_be_read_is_refused_by_name(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir
):
    with pytest.raises(UserInputError, match="'falcon' is not one mlxtune trains"):
        load_model(write_minimal(tmp_path / "falcon.gguf", arch="falcon"))
    scaled = write_minimal(tmp_path / "yarn.gguf", extra=[("llama.rope.scaling.type", "yarn")])
    with pytest.raises(UserInputError, match="rope scaling 'yarn'"):
        load_model(scaled)
    adapter = write_minimal(tmp_path / "adapter.gguf", extra=[("general.type", "adapter")])
    with pytest.raises(UserInputError, match="is a 'adapter', not a model"):
        load_model(adapter)
    _, _, f32 = export(model_dir_factory("llama"), tokenizer, tokenizer_dir, tmp_path / "f32")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f32.read_bytes()[: f32.stat().st_size // 2])
    with pytest.raises(UserInputError, match="not a readable GGUF file") as e:
        load_model(cut)
    assert e.value.where == str(cut)
    r = gguf.GGUFReader(str(f32))
    names = [t.name for t in r.tensors]
    extra = copy_with_types(f32, tmp_path / "ok.gguf", lambda n, s: gguf.GGMLQuantizationType.F32)
    assert load_model(extra)[1]["num_hidden_layers"] == 2
    missing = tmp_path / "missing.gguf"
    w = gguf.GGUFWriter(str(missing), "llama")
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            if f.types[0] != gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, f.contents(), f.types[0])
    for t in r.tensors:
        if t.name != "blk.1.ffn_up.weight":
            w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.0.mystery.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "blk.1.ffn_up.weight" in names
    with pytest.raises(UserInputError, match="blk.0.mystery.weight has no place in a llama model"):
        load_model(missing)


def test_a_tensor_llama_cpp_wrote_without_its_unit_axis_takes_its_parameters_shape():
    """llama.cpp's quantizer writes Qwen2-MoE's [1, hidden] shared-expert gate as [hidden]:
    the weight takes its parameter's shape; any other difference stays for the loader to
    refuse."""
    import mlx.nn as nn

    from mlxtune.models.gguf.load import _unit_axes_restored

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(6, 1, bias=False)
            self.proj = nn.Linear(6, 4, bias=False)

    flat = mx.arange(6, dtype=mx.float32)
    out = dict(
        _unit_axes_restored(Gate(), [("gate.weight", flat), ("proj.weight", mx.zeros((6, 4)))])
    )
    assert out["gate.weight"].shape == (1, 6)
    np.testing.assert_array_equal(np.array(out["gate.weight"])[0], np.arange(6))
    assert out["proj.weight"].shape == (6, 4)  # transposed, not a unit axis: left as it came
