"""Loading models of every supported family from Hugging Face layout, splitting them into
backbone and head, tokenizer conversion, and the errors for bad model directories."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import FAMILIES
from mlxtune.adapters import apply_adapters
from mlxtune.errors import UserInputError
from mlxtune.kernels import linear_cross_entropy
from mlxtune.models import lm_parts, load_model, resolve_model_path
from mlxtune.tokenizer import load_tokenizer, sentencepiece_to_tokenizers


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_and_backbone_plus_head_gives_the_models_logits(family, model_dir_factory):
    model, config = load_model(model_dir_factory(family))
    assert config["model_type"] == family
    parts = lm_parts(model)
    x = mx.array([[1, 5, 9, 12, 7, 3]])
    logits = model(x).astype(mx.float32)
    h = parts.hidden(x)
    ours = parts.logits(h)
    np.testing.assert_allclose(np.array(ours), np.array(logits), rtol=1e-4, atol=1e-4)
    # and the loss through the head equals cross-entropy of the model's own logits
    t = mx.array([5, 9, 12, 7, 3, 2])
    loss, _ = linear_cross_entropy(h[0], parts.head_weight(), t, softcap=parts.softcap)
    ref = (
        mx.logsumexp(logits[0], axis=-1) - mx.take_along_axis(logits[0], t[:, None], axis=-1)[:, 0]
    ).sum()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4)
    info = apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    assert info["adapted"]


def test_model_dtype_is_applied(model_dir_factory):
    model, _ = load_model(model_dir_factory("llama"), dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_missing_weights_and_pickles_are_refused(tmp_path, llama_dir):
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(UserInputError, match="no model\\*.safetensors"):
        load_model(d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(UserInputError, match="pickled .bin weights are never loaded"):
        load_model(d)


def copy_with_config(src, dst, **changes):
    """A copy of a model directory with some config.json keys changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_model_type_mlx_lm_does_not_know_is_refused(tmp_path, llama_dir):
    d = copy_with_config(llama_dir, tmp_path / "m", model_type="no_such_family")
    with pytest.raises(UserInputError, match="'no_such_family' is not a model type mlx-lm knows"):
        load_model(d)


def test_remote_code_needs_the_recipe_to_ask(tmp_path, llama_dir):
    d = copy_with_config(llama_dir, tmp_path / "m", model_file="custom.py")
    (d / "custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(UserInputError, match="trust_remote_code"):
        load_model(d)


def test_missing_model_directory(tmp_path):
    with pytest.raises(UserInputError, match="model directory not found"):
        resolve_model_path(str(tmp_path / "nope"), None)


def test_converted_tokenizer_matches_sentencepiece(tokenizer_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    tk = sentencepiece_to_tokenizers((tokenizer_dir / "tokenizer.model").read_bytes())
    for text in [
        "reverse abc = cba",
        "  hello   there ",
        "the quick brown fox",
        "unseen Q chars!",
        "ﬁ",
    ]:
        assert tk.encode(text, add_special_tokens=False).ids == sp.encode(text)
    tok = load_tokenizer(tokenizer_dir)
    ids = list(tok.encode("reverse abc"))
    assert ids[0] == tok.bos_token_id == 1 and ids[1:] == sp.encode("reverse abc")
    assert tok.decode(ids[1:]) == "reverse abc"
    assert tok.eos_token_id == 2


def test_tokenizer_directory_errors(tmp_path):
    with pytest.raises(UserInputError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(UserInputError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_tokenizer_bigger_than_the_model_is_refused(tmp_path, data_dir, tokenizer, tokenizer_dir):
    from conftest import tiny_arch, tiny_recipe
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.models import build_model, save_model

    model, config = build_model(tiny_arch("llama", vocab_size=8), 8)
    small, _ = save_model(model, config, tmp_path / "small", tokenizer, tokenizer_dir)
    with pytest.raises(
        UserInputError,
        match=r"the tokenizer \(.*\) has .* tokens but the model's vocabulary \(.*small\) is 8",
    ):
        Trainer(recipe_from_dict(tiny_recipe(data_dir, small)), run_dir=tmp_path / "r")


def test_hub_id_that_cannot_be_fetched_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserInputError, match="fetching it from the Hugging Face Hub failed") as e:
        resolve_model_path("mlxtune-tests/no-such-model", None)
    assert "mlxtune-tests/no-such-model" in str(e.value)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "phi3"])
def test_kernel_attention_gives_the_same_logits_and_gradients(
    family, model_dir_factory, monkeypatch
):
    from mlx.utils import tree_flatten

    from mlxtune import kernels
    from mlxtune.models import kernel_attention

    calls = []
    chunked = kernels.ATTENTION_IMPLS["chunked"]
    monkeypatch.setitem(
        kernels.ATTENTION_IMPLS, "chunked", lambda *a: calls.append(1) or chunked(*a)
    )

    model, _ = load_model(model_dir_factory(family))
    x = mx.array([[1, 5, 9, 12, 7, 3, 4, 8], [2, 6, 6, 1, 9, 9, 3, 5]])

    def loss(model):
        return (model(x).astype(mx.float32) ** 2).mean()

    grad = lambda: dict(tree_flatten(nn.value_and_grad(model, loss)(model)[1]))  # noqa: E731
    base_logits, base_grads = model(x), grad()
    import sys

    module = sys.modules[type(model).__module__]
    original = module.scaled_dot_product_attention
    with kernel_attention(model, "chunked") as ka:
        assert ka.active and module.scaled_dot_product_attention is not original
        logits, grads = model(x), grad()
    assert module.scaled_dot_product_attention is original
    assert len(calls) >= 2 * 2  # every layer, forward and under grad
    np.testing.assert_allclose(np.array(logits), np.array(base_logits), rtol=1e-4, atol=1e-5)
    for k in base_grads:
        np.testing.assert_allclose(
            np.array(grads[k]), np.array(base_grads[k]), rtol=1e-3, atol=1e-6
        )


def test_kernel_attention_leaves_cached_generation_to_mlx_lm(llama_dir, tokenizer):
    from mlxtune.generate import eos_ids, generate_ids
    from mlxtune.models import kernel_attention

    model, _ = load_model(llama_dir)
    prompt = [list(tokenizer.encode("reverse abc ="))]
    plain = generate_ids(model, prompt, 6, eos_ids(tokenizer))
    with kernel_attention(model, "chunked"):
        assert generate_ids(model, prompt, 6, eos_ids(tokenizer)) == plain
