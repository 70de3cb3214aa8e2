"""Loading models of every supported family from Hugging Face layout, splitting them into
backbone and head, tokenizer conversion, and the errors for bad model directories."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from conftest import FAMILIES
from mlxtune.errors import UserInputError
from mlxtune.kernels import linear_cross_entropy
from mlxtune.lora import apply_adapters
from mlxtune.models import SUPPORTED, lm_parts, load_model, resolve_model_path
from mlxtune.tokenizer import load_tokenizer, sentencepiece_to_tokenizers


def test_every_supported_family_has_a_test_model():
    assert set(FAMILIES) == set(SUPPORTED)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_and_backbone_plus_head_gives_the_models_logits(family, model_dir_factory):
    model, config = load_model(model_dir_factory(family))
    assert config["model_type"] == family
    parts = lm_parts(model)
    x = mx.array([[1, 5, 9, 12, 7, 3]])
    logits = model(x).astype(mx.float32)
    h = parts.hidden(x)
    ours = h @ parts.head_weight().T
    if parts.softcap is not None:
        ours = parts.softcap * mx.tanh(ours / parts.softcap)
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


def test_unsupported_architecture_names_the_supported_ones(tmp_path, llama_dir):
    d = copy_with_config(llama_dir, tmp_path / "m", model_type="mamba")
    with pytest.raises(UserInputError, match="'mamba' is not supported.*llama"):
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
    small = save_model(model, config, tmp_path / "small", tokenizer, tokenizer_dir)
    with pytest.raises(
        UserInputError, match="the tokenizer has .* tokens but the model's vocabulary is 8"
    ):
        Trainer(recipe_from_dict(tiny_recipe(data_dir, small)), run_dir=tmp_path / "r")


def test_hub_id_that_cannot_be_fetched_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserInputError, match="fetching it from the Hugging Face Hub failed") as e:
        resolve_model_path("mlxtune-tests/no-such-model", None)
    assert "mlxtune-tests/no-such-model" in str(e.value)
