"""GGUF: written natively, read back with the gguf package (llama.cpp's reader), and checked by
a numpy forward pass that follows llama.cpp's conventions (interleaved rope on the stored q/k)."""

import math

import gguf
import mlx.core as mx
import numpy as np
import pytest
import sentencepiece as spm
from mlx.utils import tree_flatten
from test_export import trained_run

from mlxtune.cli import main
from mlxtune.errors import UserInputError
from mlxtune.export.gguf.write import permute_qk
from mlxtune.runs.checkpoint import load_trained


def read(path):
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items()}
    tensors = {}
    for t in r.tensors:
        data = np.array(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, t.tensor_type)
        tensors[t.name] = data.astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
    return fields, tensors, r


def export_gguf(run, out, dtype="f32"):
    """mlxtune export RUN --format gguf; the path of the file written."""
    assert main(["export", str(run), "--format", "gguf", "--dtype", dtype, "--out", str(out)]) == 0
    return next(out.glob("*.gguf"))


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def llama_cpp_forward(f, t, ids):
    """A forward pass the way llama.cpp computes it from a GGUF: llama ropes adjacent pairs of
    the stored q/k ("normal" rope); qwen2/qwen3 rope the two halves ("neox" rope), qwen2 adds
    q/k/v biases, qwen3 normalises each head of q and k before the rope."""
    arch = f["general.architecture"]
    n_head, n_kv = f[f"{arch}.attention.head_count"], f[f"{arch}.attention.head_count_kv"]
    eps, base = f[f"{arch}.attention.layer_norm_rms_epsilon"], f[f"{arch}.rope.freq_base"]
    x = t["token_embd.weight"][ids]
    seq = len(ids)
    hd = f.get(f"{arch}.attention.key_length") or x.shape[1] // n_head
    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(seq)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(v):  # v [T, H, hd]
        out = np.empty_like(v)
        if arch == "llama":  # rotate (v[2i], v[2i+1]) by pos * theta_i
            a, b = v[..., 0::2], v[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        else:  # rotate (v[i], v[i + hd/2])
            a, b = v[..., : hd // 2], v[..., hd // 2 :]
            out[..., : hd // 2], out[..., hd // 2 :] = a * cos - b * sin, a * sin + b * cos
        return out

    def proj(h, name):
        y = h @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    for i in range(f[f"{arch}.block_count"]):
        p = f"blk.{i}."
        h = rms(x, t[p + "attn_norm.weight"], eps)
        q = proj(h, p + "attn_q").reshape(seq, n_head, hd)
        k = proj(h, p + "attn_k").reshape(seq, n_kv, hd)
        if p + "attn_q_norm.weight" in t:
            q, k = (
                rms(q, t[p + "attn_q_norm.weight"], eps),
                rms(k, t[p + "attn_k_norm.weight"], eps),
            )
        q, k = rope(q), rope(k)
        v = proj(h, p + "attn_v").reshape(seq, n_kv, hd)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((seq, seq), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(seq, -1) @ t[p + "attn_output.weight"].T
        h = rms(x, t[p + "ffn_norm.weight"], eps)
        g = h @ t[p + "ffn_gate.weight"].T
        x = (
            x
            + ((g / (1 + np.exp(-g))) * (h @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
        )
    x = rms(x, t["output_norm.weight"], eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T


@pytest.mark.parametrize(
    "dtype, tol", [("f32", 1e-4), ("f16", 2e-2), ("bf16", 5e-2), ("q8_0", 5e-2)]
)
def test_gguf_model_matches_mlx_the_way_llama_cpp_reads_it(
    tmp_path, data_dir, llama_dir, tokenizer_dir, dtype, tol
):
    tr = trained_run(tmp_path, data_dir, llama_dir, "lora", [])
    f, t, r = read(export_gguf(tmp_path / "lora", tmp_path / f"g-{dtype}", dtype))
    assert f["general.architecture"] == "llama" and f["llama.block_count"] == 2
    # a unigram sentencepiece model: llama.cpp's Viterbi tokenizer, with the normaliser's map
    assert f["tokenizer.ggml.model"] == "t5" and len(f["tokenizer.ggml.precompiled_charsmap"]) > 0
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    assert f["tokenizer.ggml.tokens"] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert r.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    assert (
        f["tokenizer.ggml.token_type"][1] == int(gguf.TokenType.CONTROL)
        and f["tokenizer.ggml.bos_token_id"] == 1
    )
    ids = tr.train_set.examples[0].ids
    want = np.array(tr.model(mx.array([ids]))[0])
    got = llama_cpp_forward(f, t, ids)
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_q_and_k_rows_are_permuted_and_nothing_else(tmp_path, data_dir, llama_dir):
    trained_run(tmp_path, data_dir, llama_dir, "lora", [])
    _, t, _ = read(export_gguf(tmp_path / "lora", tmp_path / "g"))
    fused = load_trained(tmp_path / "lora")
    from mlxtune.export import fuse

    w = {k: np.array(v) for k, v in tree_flatten(fuse(fused.model).parameters())}
    np.testing.assert_allclose(
        t["blk.1.attn_q.weight"],
        permute_qk(w["model.layers.1.self_attn.q_proj.weight"], 4),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        t["blk.1.attn_k.weight"],
        permute_qk(w["model.layers.1.self_attn.k_proj.weight"], 2),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        t["blk.1.attn_v.weight"], w["model.layers.1.self_attn.v_proj.weight"], rtol=1e-6
    )


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_gguf_adapter_applies_as_llama_cpp_applies_it(tmp_path, data_dir, llama_dir):
    trained_run(tmp_path, data_dir, llama_dir, "lora", ["gguf-adapter"])
    f, ad, _ = read(tmp_path / "lora" / "export" / "gguf-adapter" / "adapter.gguf")
    assert (
        f["general.type"] == "adapter"
        and f["adapter.type"] == "lora"
        # rsLoRA's scale alpha / sqrt(r) = 8 / 2, which llama.cpp reads as alpha / r
        and f["adapter.lora.alpha"] == pytest.approx(8.0 / math.sqrt(4) * 4)
    )
    assert f["general.architecture"] == "llama"
    assert ad["blk.1.attn_q.weight.lora_a"].shape == (4, 32) and ad[
        "blk.1.attn_q.weight.lora_b"
    ].shape == (32, 4)
    # base GGUF + alpha/r * B @ A (llama.cpp's rule) == the fused model's GGUF tensor
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import load_model
    from mlxtune.tokenizer import load_tokenizer

    base, cfg = load_model(llama_dir)
    (tmp_path / "base").mkdir()
    _, bt, _ = read(
        write_gguf_model(base, cfg, load_tokenizer(llama_dir), llama_dir, tmp_path / "base", "f32")
    )
    _, ft, _ = read(export_gguf(tmp_path / "lora", tmp_path / "fz"))
    for name in ("blk.1.attn_q.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"):
        merged = (
            bt[name] + (f["adapter.lora.alpha"] / 4) * ad[name + ".lora_b"] @ ad[name + ".lora_a"]
        )
        np.testing.assert_allclose(merged, ft[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_gemma_phi3_and_gemma2_follow_llama_cpp_conventions(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir
):
    """Checked against llama.cpp by hand (logits within 3e-4); these pin the conventions."""
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import load_model

    for family in ("gemma", "gemma2", "phi3"):
        model, cfg = load_model(model_dir_factory(family))
        w = dict(tree_flatten(model.parameters()))
        d = tmp_path / family
        d.mkdir()
        f, t, _ = read(write_gguf_model(model, cfg, tokenizer, tokenizer_dir, d, "f32"))
        assert f["general.architecture"] == family
        if family in ("gemma", "gemma2"):  # llama.cpp multiplies by w; gemma by (1 + w)
            np.testing.assert_allclose(
                t["blk.0.attn_norm.weight"],
                np.array(w["model.layers.0.input_layernorm.weight"]) + 1,
            )
            np.testing.assert_allclose(
                t["output_norm.weight"], np.array(w["model.norm.weight"]) + 1
            )
            assert "output.weight" not in t and f[f"{family}.attention.key_length"] == 8
        if family == "gemma2":
            norms = {"post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_norm"}
            assert norms <= {n.split(".")[2] for n in t if n.startswith("blk.0.")}
            assert (
                f["gemma2.final_logit_softcapping"] == 5.0
                and f["gemma2.attn_logit_softcapping"] == 50.0
            )
        if family == "phi3":  # fused projections keep their fused shape
            assert t["blk.0.attn_qkv.weight"].shape == (3 * 32, 32) and t[
                "blk.0.ffn_up.weight"
            ].shape == (2 * 64, 32)
            assert "output.weight" in t


def test_gemma2_with_a_query_scale_llama_cpp_ignores_is_refused(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir
):
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import load_model

    model, cfg = load_model(model_dir_factory("gemma2", query_pre_attn_scalar=16.0))
    with pytest.raises(UserInputError, match="query_pre_attn_scalar is 16, not head_dim 8"):
        write_gguf_model(model, cfg, tokenizer, tokenizer_dir, tmp_path, "f32")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_match_mlx_the_way_llama_cpp_reads_them(
    tmp_path, model_dir_factory, tokenizer, tokenizer_dir, family
):
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import load_model

    model, cfg = load_model(model_dir_factory(family))
    if family == "qwen2":  # non-zero biases, so that a wrong name or order shows
        for layer in model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(layer.self_attn, name)
                proj.bias = mx.random.normal(proj.bias.shape) * 0.5
    f, t, _ = read(write_gguf_model(model, cfg, tokenizer, tokenizer_dir, tmp_path, "f32"))
    assert f["general.architecture"] == {"mistral": "llama"}.get(family, family)
    ids = [1, 5, 9, 12, 7, 3, 4, 8, 20, 11]
    want = np.array(model(mx.array([ids]))[0])
    np.testing.assert_allclose(llama_cpp_forward(f, t, ids), want, rtol=1e-3, atol=1e-4)


def test_what_gguf_cannot_write_yet_is_named(tmp_path, llama_dir, tokenizer):
    from mlxtune.export.gguf.write import _arch, write_gguf_model
    from mlxtune.models import load_model

    with pytest.raises(UserInputError, match="llama.cpp lists 'gptj' but has no model for it"):
        _arch({"model_type": "gptj"})
    with pytest.raises(UserInputError, match="llama.cpp has no architecture for 'telechat3'"):
        _arch({"model_type": "telechat3"})
    model, cfg = load_model(llama_dir)
    with pytest.raises(UserInputError, match="needs a sentencepiece tokenizer.model"):
        write_gguf_model(
            model, cfg, tokenizer, tmp_path, tmp_path, "f32"
        )  # no tokenizer.model there


def bpe_tokenizer_dir(path, style):
    """A byte-level BPE tokenizer.json trained here, GPT-2 or Qwen2 style pre-tokenization."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mlxtune.export.gguf.vocab import _PRE_PATTERNS

    tk = Tokenizer(models.BPE())
    if style == "gpt-2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        pattern = (
            next(k for k, v in _PRE_PATTERNS.items() if v == style)
            if style in _PRE_PATTERNS.values()
            else style
        )
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tk.decoder = decoders.ByteLevel()
    corpus = [
        "reverse hello = olleh",
        "The quick brown fox jumps.",
        "Numbers 12345!",
        "ünïcödé émigré",
    ] * 30
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(
        str(path)
    )
    return path


@pytest.mark.parametrize("style", ["gpt-2", "qwen2"])
def test_bpe_vocabulary_is_written_as_llama_cpp_gpt2_tokenizer(tmp_path, style):
    """Checked against llama.cpp by hand: identical tokens on unicode, digits and whitespace."""
    import json

    from conftest import tiny_arch
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import build_model
    from mlxtune.tokenizer import load_tokenizer

    tok_dir = bpe_tokenizer_dir(tmp_path / "tok", style)
    tok = load_tokenizer(tok_dir)
    model, cfg = build_model(tiny_arch("qwen2"), len(tok._tokenizer))
    f, _, r = read(write_gguf_model(model, cfg, tok, tok_dir, tmp_path, "f32"))
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == style
    vocab = spec["model"]["vocab"]
    assert [f["tokenizer.ggml.tokens"][i] for i in sorted(vocab.values())] == sorted(
        vocab, key=vocab.get
    )
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert f["tokenizer.ggml.merges"] == merges and len(merges) > 20
    eos = tok.eos_token_id
    assert f["tokenizer.ggml.eos_token_id"] == eos and f["tokenizer.ggml.token_type"][eos] == int(
        gguf.TokenType.CONTROL
    )


def test_unknown_bpe_pre_tokenizer_is_refused(tmp_path):
    from conftest import tiny_arch
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import build_model
    from mlxtune.tokenizer import load_tokenizer

    tok_dir = bpe_tokenizer_dir(tmp_path / "tok", r"\p{L}+|\s+|[^\s\p{L}]+")
    tok = load_tokenizer(tok_dir)
    model, cfg = build_model(tiny_arch("qwen2"), len(tok._tokenizer))
    with pytest.raises(UserInputError, match="pre-tokenizer is not one llama.cpp knows"):
        write_gguf_model(model, cfg, tok, tok_dir, tmp_path, "f32")


def test_a_char_sentencepiece_model_uses_llama_cpp_llama_tokenizer(tmp_path):
    from conftest import REPO
    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.models import load_model
    from mlxtune.tokenizer import load_tokenizer

    base = REPO / "recipes" / "models" / "reverse-tiny"  # the quickstart's char tokenizer
    model, cfg = load_model(base)
    f, _, _ = read(write_gguf_model(model, cfg, load_tokenizer(base), base, tmp_path, "f32"))
    assert f["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.precompiled_charsmap" not in f


def test_a_large_weight_is_quantized_to_q8_0_a_block_of_rows_at_a_time(monkeypatch):
    """Row blocks give the same Q8_0 bytes as the whole weight quantized at once."""
    from mlxtune.export.gguf import write

    a = np.random.default_rng(0).standard_normal((37, 96)).astype(np.float32)
    whole = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(write, "_QUANTIZE_ELEMENTS", 96 * 5)  # 5 rows a block, 8 blocks
    got, raw = write._tensor_array(a, "q8_0")
    assert raw == gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(got, whole)
