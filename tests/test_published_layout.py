"""Mixtures of experts, MLA and hybrids saved in the published layout: a checkpoint transformers
5 writes loads in mlxtune as transformers runs it (its config keys read as transformers reads
them), and saving it again (what the fused export does) gives back transformers' own file,
every tensor under the same name with the same values: experts one by one again, MLA's
``kv_b_proj`` whole, conv weights in torch's order, shifted norms unshifted."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm_archs import tiny_config
from test_interop import interop

from mlxtune.models import load_model, save_model
from mlxtune.models.configs import normalise_config

IDS = [1, 5, 9, 12, 7, 3, 30, 4, 8, 17, 2, 40]

# family -> how far mlx-lm's logits may sit from transformers' (None: not compared)
FAMILIES = {
    "mixtral": 1e-4,
    "qwen3_moe": 1e-4,  # transformers 5 writes num_local_experts; mlx-lm reads num_experts
    "qwen2_moe": 1e-4,
    "olmoe": 1e-4,
    "granitemoe": 1e-4,  # experts as input_linear (gate and up joined) / output_linear
    "glm4_moe": 1e-4,  # no rope_scaling key; mlx-lm's ModelArgs requires one
    "deepseek_v3": None,  # MLA; transformers' own forward fails at this size
    "lfm2": 1e-4,  # conv weights
    "lfm2_moe": 1e-4,  # w1/w2/w3 in dense and expert MLPs alike
    "qwen3_next": 1e-4,  # (1 + w) norms, conv, experts; layer_types for full_attention_interval
    "nemotron_h": 1e-4,  # experts as up/down (fc1/fc2 in mlx-lm)
    "granitemoehybrid": 1e-3,  # "mamba"/"attention" layer types, written as new names
    "falcon_h1": 1e-4,
    "mamba2": 1e-4,
    "jamba": None,  # mlx-lm's forward differs from transformers' (~0.2 in logits)
    "gpt2": 1e-4,  # Conv1D weights ([in, out]), names without the "model." prefix
    "gpt_neox": 1e-4,
    "apertus": 1e-4,  # the activation's learned scalars: [1] in the file, 0-d as mlx-lm holds them
}


def saved_by_transformers(torch, name, folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**tiny_config(name, 64), "pad_token_id": 0}
    if name == "gpt_neox":  # mlx-lm's MLP: 4x wide, tanh-approximated GELU whatever the config
        cfg.update(intermediate_size=4 * cfg["hidden_size"], hidden_act="gelu_fast")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # away from the initialisation's zeros and ones (norms, biases)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_published_layout_reads_and_saves_back_as_transformers_wrote_it(tmp_path, name):
    torch = interop("torch")
    from safetensors.numpy import load_file

    hf = saved_by_transformers(torch, name, tmp_path / "hf")
    model, config = load_model(tmp_path / "hf")
    if FAMILIES[name] is not None:
        with torch.no_grad():
            want = hf(torch.tensor([IDS])).logits[0].numpy()
        got = np.array(model(mx.array([IDS]))[0])
        np.testing.assert_allclose(got, want, rtol=FAMILIES[name], atol=FAMILIES[name])
    folder, published = save_model(model, config, tmp_path / "saved")
    assert published
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    if name == "gpt2":  # published by OpenAI without transformers' prefix; both forms read
        theirs = {k.removeprefix("transformer."): v for k, v in theirs.items()}
    ours = load_file(folder / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert ours[k].shape == v.shape, k
        np.testing.assert_allclose(ours[k], v, rtol=0, atol=1e-6, err_msg=k)


def test_a_family_with_no_published_layout_is_saved_as_held_and_says_so(tmp_path):
    """gpt-oss: mlx-lm reads its experts from the [experts, 2 x intermediate, hidden] layout
    of the original checkpoint, which no rewrite of the held weights reaches."""
    from mlxtune.models import family_classes

    config = tiny_config("gpt_oss", 64)
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(config))
    folder, published = save_model(model, config, tmp_path / "m")
    assert not published
    reloaded, _ = load_model(folder)
    np.testing.assert_array_equal(
        np.array(reloaded(mx.array([IDS]))[0]), np.array(model(mx.array([IDS]))[0])
    )


def test_transformers_5_renames_are_read_back_for_mlx_lm():
    from mlx_lm.models import granitemoehybrid, qwen3_moe, qwen3_next

    got = normalise_config({"model_type": "qwen3_moe", "num_local_experts": 8}, qwen3_moe.ModelArgs)
    assert got["num_experts"] == 8
    got = normalise_config(
        {"model_type": "qwen3_next", "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
        qwen3_next.ModelArgs,
    )
    assert got["full_attention_interval"] == 4
    types = ["linear_attention", "full_attention", "linear_attention"]
    got = normalise_config(
        {"model_type": "granitemoehybrid", "layer_types": types}, granitemoehybrid.ModelArgs
    )
    assert got["layer_types"] == ["mamba", "attention", "mamba"]
    # a layout the interval cannot express is refused, naming the key
    from mlxtune.errors import UserInputError

    odd = ["full_attention", "linear_attention", "linear_attention"]
    with pytest.raises(UserInputError, match="layer_types"):
        normalise_config({"model_type": "qwen3_next", "layer_types": odd}, qwen3_next.ModelArgs)


def test_a_config_without_a_key_the_family_requires_is_refused_by_name(tmp_path, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    from mlxtune.errors import UserInputError

    with pytest.raises(UserInputError, match="hidden_size"):
        load_model(tmp_path)


def test_multipliers_folded_into_weights_are_taken_back_out(tmp_path):
    """Falcon-H1: mlx-lm folds its muP multipliers into the weights as it loads (one scale per
    matrix, one per row of the SSM's input projection); the published layout holds them apart."""
    torch = interop("torch")
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**tiny_config("falcon_h1", 64), "pad_token_id": 0}
    multipliers = {
        "embedding_multiplier": 5.0,
        "lm_head_multiplier": 0.25,
        # mlx-lm 0.32 folds attention_in_multiplier into q and k but not v, and
        # key_multiplier nowhere (it matches "key_proj"): left at 1 here, and named in README
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.75,
        "key_multiplier": 1.0,
        "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.5,
        "mlp_multipliers": [2.0, 0.5],
        "ssm_multipliers": [1.0, 0.5, 2.0, 1.5, 0.75],
    }
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg, **multipliers)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        want = hf(torch.tensor([IDS])).logits[0].numpy()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model, loaded = load_model(tmp_path / "hf")
    np.testing.assert_allclose(np.array(model(mx.array([IDS]))[0]), want, rtol=1e-4, atol=1e-4)
    folder, published = save_model(model, loaded, tmp_path / "saved")
    assert published
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    ours = load_file(folder / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        np.testing.assert_allclose(ours[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_peft_export_of_layers_published_transposed_is_refused_by_name(name):
    """GPT-2's attention and MLP are Conv1D layers in its published layout ([in, out]), which
    PEFT adapts under transformers' module names with its own convention: mlxtune's PEFT
    export would name layers nothing applies, so it is refused before training (fused and
    mlx-lm exports remain). Linear layers (Llama's) export."""
    from mlxtune.adapters import apply_adapters
    from mlxtune.export import peft_refusal
    from mlxtune.models import family_classes

    cfg = tiny_config(name, 64)
    model_class, args_class = family_classes(cfg)
    model = model_class(args_class.from_dict(normalise_config(cfg, args_class)))
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    why = peft_refusal(model)
    if name == "llama":
        assert why is None
    else:
        assert "Conv1D" in why and "h.0.attn.c_attn" in why


def test_a_router_published_as_its_modules_own_weight_is_saved_so(tmp_path):
    """Ling 2.0 (bailing_moe): the router's weight and expert bias sit on the gate module itself
    in its published checkpoints (``mlp.gate.weight``, ``mlp.gate.expert_bias``, the names
    llama.cpp's converter maps), where mlx-lm holds the weight in a ``gate_proj`` inside it."""
    from safetensors.numpy import load_file

    from mlxtune.models import family_classes

    config = {
        **tiny_config("bailing_moe", 64),
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
    }
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    folder, published = save_model(model, config, tmp_path / "m")
    assert published
    names = set()
    for f in folder.glob("*.safetensors"):
        names |= set(load_file(str(f)))
    moe = config["first_k_dense_replace"]  # the first mixture layer
    assert {
        f"model.layers.{moe}.mlp.gate.weight",
        f"model.layers.{moe}.mlp.gate.expert_bias",
    } <= names
    assert f"model.layers.{moe}.mlp.experts.0.gate_proj.weight" in names
    assert not any(".gate.gate_proj." in n for n in names)
    reloaded, _ = load_model(folder)
    np.testing.assert_array_equal(
        np.array(reloaded(mx.array([IDS]))[0]), np.array(model(mx.array([IDS]))[0])
    )


def test_a_default_malformed_in_mlx_lm_is_not_written_into_the_saved_config(tmp_path):
    """mlx-lm's dots1 declares ``scoring_func: str`` with the default ``("noaux_tc",)`` (a
    stray comma) and routes by a sigmoid whatever it says; written out, the one-element list
    made llama.cpp's converter refuse the folder. Defaults of their declared type are kept."""
    from mlxtune.models import family_classes

    config = tiny_config("dots1", 64)
    for k in ("n_group", "topk_group"):  # left to mlx-lm's defaults (1 and 1)
        del config[k]
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    folder, _ = save_model(model, config, tmp_path / "m")
    saved = json.loads((folder / "config.json").read_text())
    assert "scoring_func" not in config and "scoring_func" not in saved
    assert saved["n_group"] == 1 and saved["topk_group"] == 1  # defaults of their type: kept


def test_a_string_window_pattern_is_saved_with_the_layer_types_it_means(tmp_path):
    """EXAONE 4 runs its sliding and global layers from ``sliding_window_pattern: "LG"``;
    its published configs hold ``layer_types`` beside it, and transformers 5 reads a string
    pattern only with the list. The saved config spells the list out, transformers reads it,
    and mlxtune reads the folder back to the same layers."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from mlxtune.models import family_classes

    config = tiny_config("exaone4", 64)
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    folder, _ = save_model(model, config, tmp_path / "m")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["sliding_window_pattern"] == "LG"
    assert saved["layer_types"] == ["sliding_attention", "full_attention"]
    assert AutoConfig.from_pretrained(folder).layer_types == saved["layer_types"]
    reloaded, _ = load_model(folder)
    assert [layer.self_attn.is_local for layer in reloaded.model.layers] == [True, False]
