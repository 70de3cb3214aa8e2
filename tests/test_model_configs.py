"""Model folders saved by transformers 5 (RoPE settings only inside ``rope_parameters``, the
sliding-window layout as ``layer_types``) run in mlxtune as transformers runs them: the logits
are transformers' own, computed from the same folder. Settings mlx-lm cannot honour are refused.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from test_interop import interop

from mlxtune.errors import UserInputError
from mlxtune.models import load_model
from mlxtune.models.configs import normalise_config, rope_base

IDS = [1, 5, 9, 12, 7, 3, 30, 4, 8, 17, 2, 40]


def saved_by_transformers(torch, tmp_path, config):
    """A random model of ``config`` saved by transformers (its own config.json), and its logits
    of IDS."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights larger than the default init, so the RoPE base shows
        for p in model.parameters():
            p.mul_(4.0) if p.ndim >= 2 else None
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, ref


def mlxtune_logits(path):
    model, config = load_model(path)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32)), config


def llama_config(**rope):
    """A tiny LlamaConfig as transformers makes it, with RoPE settings ``rope``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=False,
        **rope,
    )


def test_llama_saved_by_transformers_5_runs_at_its_rope_base(tmp_path):
    torch = interop("torch")
    cfg = llama_config(rope_theta=100.0)
    path, ref = saved_by_transformers(torch, tmp_path, cfg)
    written = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in written and written["rope_parameters"]["rope_theta"] == 100.0
    ours, config = mlxtune_logits(path)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    assert config["rope_theta"] == 100.0 and rope_base(written) == 100.0
    # mlx-lm alone reads no rope_parameters: the check above can tell the bases apart
    from mlx_lm.utils import load_model as mlx_lm_load

    plain, _ = mlx_lm_load(path)
    assert np.abs(np.array(plain(mx.array([IDS]))[0]) - ref).max() > 1e-2


def test_llama3_rope_scaling_inside_rope_parameters(tmp_path):
    torch = interop("torch")
    cfg = llama_config(
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    )
    path, ref = saved_by_transformers(torch, tmp_path, cfg)
    ours, config = mlxtune_logits(path)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    assert config["rope_scaling"]["rope_type"] == "llama3"


def test_gemma3_per_layer_type_rope_and_sliding_layout(tmp_path):
    torch = interop("torch")
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=32,
        num_hidden_layers=3,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 300.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    )
    path, ref = saved_by_transformers(torch, tmp_path, cfg)
    ours, config = mlxtune_logits(path)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    assert config["sliding_window_pattern"] == 2
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (300.0, 50.0)


def test_settings_mlx_lm_cannot_honour_are_refused():
    from mlx_lm.models import gemma2, gemma3_text, llama

    rp = {"rope_parameters": {"rope_type": "no-such-rope", "rope_theta": 10.0}}
    with pytest.raises(UserInputError, match="RoPE type 'no-such-rope' cannot be run"):
        normalise_config({"model_type": "llama", **rp}, llama.ModelArgs)
    # gemma2's module reads no scaling at all: a scaled rope would silently run plain
    scaled = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}}
    with pytest.raises(UserInputError, match="reads no RoPE scaling"):
        normalise_config({"model_type": "gemma2", **scaled}, gemma2.ModelArgs)
    nested = {
        "full_attention": {"rope_type": "default", "rope_theta": 10.0},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0},
    }
    with pytest.raises(UserInputError, match="on sliding-window layers"):
        normalise_config({"rope_parameters": nested}, gemma3_text.ModelArgs)
    odd = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(UserInputError, match="layer_types"):
        normalise_config({"layer_types": odd}, gemma3_text.ModelArgs)
    # a top-level rope_scaling wins, as in transformers; a config without RoPE keys is left alone
    both = {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 7.0, **rp}
    assert normalise_config(both, llama.ModelArgs) == both
    assert normalise_config({"hidden_size": 8}, llama.ModelArgs) == {"hidden_size": 8}


@pytest.mark.parametrize("name", ["gemma3_text", "olmo2", "granite", "smollm3"])
def test_a_saved_model_of_a_dense_family_runs_in_transformers_as_in_mlx_lm(tmp_path, name):
    """The Hugging Face layout mlxtune saves (what the fused export writes) of newer dense
    families: transformers reads every weight and computes mlx-lm's logits."""
    torch = interop("torch")
    from mlx_lm_archs import tiny_config
    from test_interop import from_pretrained

    from mlxtune.models import family_classes, save_model

    mx.random.seed(0)
    config = {**tiny_config(name, 64), "pad_token_id": 0}
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(config))
    want = np.array(model(mx.array([IDS]))[0])
    save_model(model, config, tmp_path)
    hf = from_pretrained(torch, tmp_path)
    with torch.no_grad():
        got = hf(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_ministral3_saved_by_transformers_runs_as_transformers_runs_it(tmp_path):
    """Ministral 3's RoPE (yarn, with Llama 4's attention temperature in rope_parameters) read
    as transformers reads it. Its config without a sliding window: with one, transformers slides
    every layer and mlx-lm only the layer_types' sliding ones."""
    torch = interop("torch")
    from mlx_lm_archs import tiny_config
    from transformers import AutoConfig

    cfg = {**tiny_config("ministral3", 64), "sliding_window": None, "pad_token_id": 0}
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    path, ref = saved_by_transformers(torch, tmp_path, config)
    got, _ = mlxtune_logits(path)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_a_sliding_pattern_in_letters_beside_layer_types_is_kept():
    """EXAONE 4 reads ``sliding_window_pattern`` as letters ("LLLG"). A config giving it beside
    ``layer_types`` keeps it; one giving ``layer_types`` alone gets its letters; the model
    builds and runs either way."""
    from mlx_lm.models import exaone4
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model

    base = {**tiny_config("exaone4", 64), "num_hidden_layers": 4}
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    given = {**base, "layer_types": kinds, "sliding_window_pattern": "LLLG"}
    alone = {k: v for k, v in given.items() if k != "sliding_window_pattern"}
    for config in (given, alone):
        assert normalise_config(config, exaone4.ModelArgs)["sliding_window_pattern"] == "LLLG"
        model, _ = build_model(config, 64, seed=0)
        local = [layer.self_attn.is_local for layer in model.model.layers]
        assert local == [True, True, True, False]
        assert model(mx.array([IDS])).shape == (1, len(IDS), 64)
