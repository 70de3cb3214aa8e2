"""GGUF export and import of the newer families: mixtures of experts (Mixtral, Qwen2/3-MoE,
OLMoE, Granite MoE), OLMo 2, Granite, SmolLM3, Gemma 3 and LFM2.

The export is checked in llama.cpp itself (llama-cpp-python, the ``llama_cpp`` marker: the
same logits as mlx-lm's from the file it reads). Without llama.cpp, the default run checks
what the file says against the model (every tensor under llama.cpp's converter's name, its
shape and values undone from llama.cpp's conventions by a NumPy reading written here, the
metadata llama.cpp's loader needs), and that mlxtune reads its own file back to the same
logits. What llama.cpp fixes per architecture and a model does otherwise is refused by name.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm_archs import tiny_config

from mlxtune.errors import UserInputError
from mlxtune.export.gguf.write import write_gguf_model
from mlxtune.models import family_classes, load_gguf
from mlxtune.models.configs import normalise_config
from mlxtune.models.moe import router_paths

# model type -> settings llama.cpp fixes for its architecture, where the tiny config differs
FAMILIES = {
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {"norm_topk_prob": True},
    "olmoe": {"norm_topk_prob": False, "num_key_value_heads": 4},
    "granitemoe": {},
    "olmo2": {},
    "granite": {},
    "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 4},
    "gemma3_text": {
        "num_hidden_layers": 6,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 16,
        "head_dim": 16,
    },
    "lfm2": {},
    "gpt_oss": {},
    "lfm2_moe": {},
    "glm4_moe": {},
    "glm4": {},
    "ernie4_5": {},
    "seed_oss": {},
    "gemma4_text": {},
    "qwen3_next": {},
    "qwen3_5": {},
    "qwen3_5_moe": {},
    "mamba2": {"time_step_limit": [0.0, float("inf")]},
    "stablelm": {},
    "starcoder2": {},
    "minicpm": {},
    "deepseek": {},
    "nemotron": {},
    "ministral3": {"sliding_window": None, "layer_types": ["full_attention"] * 2},
    "deepseek_v3": {},
    "glm4_moe_lite": {},
    "olmo3": {},
    "lfm2-vl": {},  # multimodal wrappers: GGUF holds the language model
    "mistral3": {"sliding_window": None, "layer_types": ["full_attention"] * 2},
    "kimi_k25": {},
    "nemotron_h": {"time_step_limit": [0.0, float("inf")]},
    "granitemoehybrid": {"time_step_limit": [0.0, float("inf")]},
    "cohere2": {"num_hidden_layers": 4, "sliding_window_pattern": 4},
    "qwen2_vl": {},
    # sections covering every pair: llama.cpp leaves a text position's others unrotated
    "qwen3_vl": {"rope_scaling": {"mrope_section": [3, 3, 2], "rope_type": "default"}},
    "qwen3_vl_moe": {"rope_scaling": {"mrope_section": [3, 3, 2], "rope_type": "default"}},
    "phi": {},
    "internlm3": {"qkv_bias": True},
    "solar_open": {},
    "minimax": {},
    "gpt2": {},
    # a no-op attention in layer 0 (written as a linear one of zeros), a no-op MLP (an all-zero
    # one), a linear attention
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"no_op": True}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}},
        ]
    },
    "kimi_linear": {},
    # scales other than MiniCPM3-4B's (which llama.cpp fixes): folded into the weights
    "minicpm3": {"scale_emb": 9.0, "scale_depth": 1.2},
    # Llama 4's: chunks of 8192, an RMS epsilon other than its q/k norm's 1e-6 (folded into the
    # roped layers' q/k rows), Scout's Llama 3 scaling (no blended band) from position 8 on
    "llama4": {
        "attention_chunk_size": 8192,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8,
        },
    },
    # Step 3.5's shape: the sliding layers with heads, a rotated share and a base of their own,
    # clamped SwiGLUs
    "step3p5": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "moe_layers_enum": "1,2",
        "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 2},
        "partial_rotary_factors": [1.0, 0.5, 1.0],
        "rope_theta": [500.0, 10000.0, 500.0],
        "swiglu_limits": [0.0, 0.5, 0.5],
        "swiglu_limits_shared": [0.5, 0.0, 0.5],
        "moe_router_scaling_factor": 2.0,
    },
    "afmoe": {  # llama.cpp's: every 4th layer full (and unroped)
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "route_scale": 2.5,
    },
    # yarn and Llama 4's attention temperature from position 4 on, inside the test's ids
    "mistral4": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.5,
        }
    },
    "mimo_v2_flash": {"n_shared_experts": None, "attention_value_scale": 0.7},
    "exaone_moe": {"routed_scaling_factor": 2.5},
    "plamo": {"num_attention_heads": 8, "n_shared_head": 4},  # 2 kv heads, each read by 4
    "plamo3": {"num_hidden_layers": 4, "rope_local_theta": 500.0},  # full layers 2 and 4
    # tied, its logits scaled at run time by lm_head_multiplier / embedding_multiplier
    "falcon_h1": {
        "tie_word_embeddings": True,
        "lm_head_multiplier": 2.0,
        "embedding_multiplier": 0.5,
        "mamba_rms_norm": True,
    },
    # a clamp that acts on the tiny model's q/k/v
    "dbrx": {"attn_config": {"kv_n_heads": 2, "clip_qkv": 0.3, "rope_theta": 10000.0}},
    "bailing_moe": {"score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    "dots1": {"num_key_value_heads": 4},
    "ernie4_5_moe": {},
    "deepseek_v2": {},
    "youtu_llm": {},
    "openelm": {"num_query_heads": [4, 2], "num_kv_heads": [2, 1]},  # per layer
    "apertus": {"tie_word_embeddings": True},
    "exaone": {},
    "qwen": {},
    "mamba": {},
    "gpt_neox": {},
    "internlm2": {"bias": False, "tie_word_embeddings": True},
    # llama.cpp's exaone4 has local layers only at 64 layers (below, at 64)
    "exaone4": {"sliding_window_pattern": None, "sliding_window": None},
    "cohere": {"use_qk_norm": False},  # llama.cpp's command-r: q/k norms from 64 layers on
    # Hunyuan's NTK alpha raises the RoPE base (llama.cpp reads the raised base)
    "hunyuan_v1_dense": {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
}
# families whose file reads back as another model type of the same architecture
READS_AS = {
    "qwen2_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "llama4": "llama4",
    "internlm3": "llama",
    "solar_open": "glm4_moe",
    "qwen3_vl_moe": "qwen3_moe",
    "glm4_moe_lite": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "lfm2-vl": "lfm2",
    "mistral3": "ministral3",
}
IDS = [1, 5, 9, 12, 7, 3, 30, 4, 8, 17, 2, 40, 11, 6]
# llama.cpp against mlx-lm, both fp32 (cache included): ggml's CPU GELU reads an f16 table
TOL = 2e-3


def read(path):
    """(metadata, tensors as numpy, the file) through mlxtune's own one-pass reader (gguf's
    reader walks a vocabulary's every string; these files are f32)."""
    from mlxtune.gguf.file import open_gguf

    r = open_gguf(path)
    return r.fields, {n: np.asarray(t.data, np.float32) for n, t in r.tensors.items()}, r


def tiny(name, vocab):
    mx.random.seed(4)
    config = tiny_config(name, vocab)
    if isinstance(config.get("text_config"), dict):  # a multimodal wrapper: its language model
        config["text_config"] = {**config["text_config"], **FAMILIES[name]}
    else:
        config = {**config, **FAMILIES[name]}
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    for path in router_paths(model):  # mlx-lm starts some routers at zero: experts would tie
        router = dict(model.named_modules())[path]
        router.weight = 0.5 * mx.random.normal(router.weight.shape)
    params = tree_flatten(model.parameters())  # norms and biases away from 1 and 0
    model.load_weights([(k, v + 0.05 * mx.random.normal(v.shape)) for k, v in params])
    return model, config


# the default run reads back one family of each kind; -m slow (and -m llama_cpp) all of them
QUICK = {"mixtral", "gemma3_text", "lfm2", "qwen3_next", "deepseek_v2", "nemotron_h", "gpt_oss"}


@pytest.fixture(
    params=[n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES]
)
def exported(request, tmp_path, tokenizer, tokenizer_dir):
    name = request.param
    model, config = tiny(name, len(tokenizer._tokenizer))
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32", name)
    want = np.array(model(mx.array([IDS]))[0])
    return name, model, config, path, want


def test_mlxtune_reads_its_gguf_export_back_to_the_same_model(exported):
    name, model, config, path, want = exported
    back, back_config, _ = load_gguf(path, "float32")
    assert back_config["model_type"] == READS_AS.get(name, name)
    if name == "bailing_moe":  # llama.cpp's bailingmoe2: Ling 2.0's class
        assert back_config["architectures"] == ["BailingMoeV2ForCausalLM"]
    np.testing.assert_allclose(np.array(back(mx.array([IDS]))[0]), want, rtol=1e-5, atol=1e-5)


def test_the_file_holds_llama_cpps_names_shapes_and_settings(exported):
    import gguf

    name, model, config, path, _ = exported
    config = config.get("text_config", config)  # a multimodal wrapper's language model
    f, t, _ = read(path)
    arch = f["general.architecture"]
    layers = len(model.layers)
    assert f[f"{arch}.block_count"] == layers
    # every tensor llama.cpp's architecture lists, under its own names, and no other
    code = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    allowed = {
        gguf.TENSOR_NAMES[k].format(bid=i) for k in gguf.MODEL_TENSORS[code] for i in range(layers)
    }
    assert {n.removesuffix(".weight").removesuffix(".bias") for n in t} <= allowed
    # beyond the parameters: rope divisors (Llama 3's, MiniCPM3's), and a tied head written out as a copy of
    # the embedding where llama.cpp's architecture reads a head of its own
    # (a copy, or scaled by the tied logits' factor: Falcon-H1's)
    tied = False
    if "output.weight" in t and t["output.weight"].shape == t["token_embd.weight"].shape:
        out, embd = t["output.weight"], t["token_embd.weight"]
        tied = np.allclose(out, (out * embd).sum() / (embd * embd).sum() * embd, rtol=1e-5)
    rope = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
    # and Nemotron-NAS's no-op sublayers, written as constant tensors (zeros behind norms of ones)
    constant = {n for n, v in t.items() if v.size > 1 and (not v.any() or (v == 1).all())}
    extra = rope | constant | ({"output.weight"} if tied else set())
    # Apertus's xIELU parameters: one value per layer in metadata arrays
    xielu = sum(len(f[k]) for k in f if k.startswith("xielu."))
    assert sum(v.size for n, v in t.items() if n not in extra) + xielu == sum(
        v.size for _, v in tree_flatten(model.parameters())
    )
    if name == "apertus":
        for key in ("alpha_p", "alpha_n", "beta", "eps"):
            held = [float(getattr(layer.mlp.act_fn, key)) for layer in model.layers]
            np.testing.assert_allclose(np.asarray(f[f"xielu.{key}"]), held, rtol=1e-6)
    experts = (
        config.get("num_experts")
        or config.get("num_local_experts")
        or config.get("n_routed_experts")
    )
    if experts:
        assert f[f"{arch}.expert_count"] == experts
        used = config.get("num_experts_per_tok") or config.get("num_experts_per_token")
        assert f[f"{arch}.expert_used_count"] == used
        stacked = [v for n, v in t.items() if "_exps." in n]
        assert stacked and all(v.shape[0] == experts for v in stacked)
    if name == "lfm2":  # conv layers are the ones without kv heads
        full = set(model.args.full_attn_idxs)
        kv = f["lfm2.attention.head_count_kv"]
        assert [i for i in range(layers) if kv[i] > 0] == sorted(full)
        assert f["lfm2.shortconv.l_cache"] == config["conv_L_cache"]
    if name.startswith("granite"):
        for key, hf in (
            ("attention.scale", "attention_multiplier"),
            ("embedding_scale", "embedding_multiplier"),
            ("residual_scale", "residual_multiplier"),
            ("logit_scale", "logits_scaling"),
        ):
            assert f[f"{arch}.{key}"] == pytest.approx(getattr(model.args, hf))
    if name == "gemma3_text":  # (1 + w) norms stored as w + 1, as llama.cpp's converter does
        w = np.array(model.model.layers[0].input_layernorm.weight)
        np.testing.assert_allclose(t["blk.0.attn_norm.weight"], w + 1, rtol=1e-6)
        assert f["gemma3.attention.sliding_window"] == config["sliding_window"]


@pytest.mark.llama_cpp
def test_llama_cpp_runs_the_gguf_export_of_each_family(exported):
    name, _, _, path, want = exported
    assert_llama_cpps_logits(path, IDS, want)


def assert_llama_cpps_logits(path, ids, want, **settings):
    """llama.cpp's logits over ``ids`` from the file at ``path`` (with ``settings``, such as
    a ``lora_path``) are ``want``."""
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="needs llama-cpp-python (compiles from source, about 13 minutes on 2 cores)",
    )
    f32 = 0  # ggml's F32: the key/value cache in full precision, as the mlx-lm side computes
    llm = llama_cpp.Llama(
        model_path=str(path), logits_all=True, n_ctx=64, verbose=False, type_k=f32, type_v=f32,
        **settings,
    )  # fmt: skip
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])
    np.testing.assert_allclose(got, want, atol=TOL * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize(
    "name, change, words",
    [
        ("qwen3_moe", {"norm_topk_prob": False}, "renormalise the routers' top-k"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "experts in every layer"),
        ("olmoe", {"norm_topk_prob": True}, "does not renormalise"),
        ("olmoe", {"num_key_value_heads": 2}, "as many key/value heads"),
        ("gemma3_text", {"sliding_window_pattern": 2}, "fixes sliding_window_pattern at 6"),
        ("smollm3", {"no_rope_layer_interval": 3}, "every 4th layer"),
        ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "even layers"),
        ("mamba2", {"time_step_limit": [0.001, 100.0]}, "clamp the SSM step"),
        ("ministral3", {"sliding_window": 4}, "sets a sliding_window"),
        ("cohere", {"use_qk_norm": True}, "64 or more layers"),
        ("cohere", {"layer_norm_bias": True}, "without biases"),
        ("internlm3", {"rope_traditional": True}, "rope_traditional"),
        ("minimax", {"use_qk_norm": False}, "normalises queries and keys"),
        ("internlm2", {"bias": True}, "no bias on the attention output"),
        ("mamba", {"intermediate_size": 96}, "twice the hidden size"),
        ("qwen", {"no_bias": False}, "no bias on the attention output"),
        ("exaone", {"mlp_bias": True}, "attention_bias or mlp_bias"),
        ("ernie4_5_moe", {"moe_gate_act": "sigmoid"}, "routes by softmax"),
        ("dots1", {"num_key_value_heads": 2}, "as many key/value heads"),
        ("mimo_v2_flash", {"n_shared_experts": 1}, "no shared experts"),
        ("mistral4", {"rms_norm_eps": 1e-5}, "epsilon of 1e-6"),
        ("afmoe", {"mup_enabled": False}, "scales the embeddings"),
        (
            "nemotron-nas",
            {"block_configs": tiny_config("nemotron-nas")["block_configs"]},
            "no linear MLP",
        ),
        ("kimi_linear", {"num_shared_experts": 0}, "adds a shared expert"),
        ("step3p5", {"rope_theta": [500.0, 10000.0, 600.0]}, "per layer type"),
        ("exaone_moe", {"layer_types": ["full_attention"] * 2}, "ropes only its sliding"),
        ("falcon_h1", {"mamba_norm_before_gate": True}, "gates before its SSM norm"),
        ("bailing_moe", {"use_qk_norm": False}, "Ling 1's layout"),
        ("openelm", {"share_input_output_layers": False}, "ties the head"),
        (
            "deepseek_v2",
            {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
            "ranks expert groups",
        ),
        ("exaone4", {"sliding_window_pattern": "LG", "sliding_window": 4}, "64 layers"),
    ],
)
def test_what_llama_cpp_fixes_otherwise_is_refused_by_name(
    tmp_path, tokenizer, tokenizer_dir, name, change, words
):
    vocab = len(tokenizer._tokenizer)
    config = {**tiny_config(name, vocab), **FAMILIES[name], **change}
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    with pytest.raises(UserInputError, match=words):
        write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize(
    "name, words",
    [
        ("phimoe", "sparsemixer"),
        ("jamba", "not renormalised"),
        ("hunyuan", "renormalises the top-k"),
        ("llama4_text", "dense model"),
        ("bitnet", "squares a ReLU"),
        ("gemma3n", "sample standard deviation"),
        ("glm_moe_dsa", "epsilon of 0"),
        ("plamo2", "clamps the SSM step"),
        ("rwkv7", "different logits"),
        ("llama4", "chunks attention by 8192 tokens"),  # the tiny config's chunk: 4
    ],
)
def test_a_family_llama_cpp_runs_otherwise_is_refused_with_the_reason(
    name, words, tmp_path, tokenizer, tokenizer_dir
):
    config = tiny_config(name, len(tokenizer._tokenizer))
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    with pytest.raises(UserInputError, match=words):
        write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize(
    "published, arch",
    [
        # Ling-lite's config.json (Ling 1): softmax router, no query/key norms
        ({"model_type": "bailing_moe", "norm_head": True, "num_shared_experts": 2}, "BailingMoe"),
        # Ling-mini-2.0's: query/key norms, a sigmoid router with an expert bias
        (
            {
                "model_type": "bailing_moe",
                "use_qk_norm": True,
                "score_function": "sigmoid",
                "moe_router_enable_expert_bias": True,
            },
            "BailingMoeV2",
        ),
    ],
)
def test_ling_configs_name_their_own_generations_class(published, arch, tmp_path):
    """mlx-lm runs Ling 1 and Ling 2.0 as one model_type; the saved config names the class each
    was published under, which llama.cpp's converter picks its code by (bailingmoe for the
    first, bailingmoe2 for the second, the layout mlxtune's GGUF export writes)."""
    from mlxtune.models.common import hf_architecture

    assert hf_architecture("bailing_moe", published) == f"{arch}ForCausalLM"


def test_an_architecture_mlxtune_does_not_write_is_refused_by_name():
    """Every mlx-lm model type with a llama.cpp architecture is written or refused with its
    reason (test_every_mlx_lm_type_is_written_or_refused); a type of another library that
    llama.cpp names is refused by name too."""
    from mlxtune.export.gguf.write import _arch

    with pytest.raises(UserInputError, match="'bloom' architecture is not one mlxtune writes"):
        _arch({"model_type": "bloom"})


def test_every_mlx_lm_type_llama_cpp_names_is_written_or_refused_with_a_reason():
    import pkgutil

    import mlx_lm.models

    from mlxtune.gguf.names import FAMILIES as WRITTEN
    from mlxtune.gguf.names import RUNS_OTHERWISE, llama_cpp_arch

    open_ = []
    for _, name, _ in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            config = tiny_config(name)
        except KeyError:  # a helper module, not a model type
            continue
        text = config.get("text_config")
        model_type = text.get("model_type", name) if isinstance(text, dict) else name
        if llama_cpp_arch(model_type) is None and llama_cpp_arch(name) is None:
            continue
        if not {name, model_type} & (set(WRITTEN) | set(RUNS_OTHERWISE) | {"llama4", "olmo"}):
            open_.append(name)
    assert not open_, (
        f"llama.cpp names an architecture for these, and mlxtune neither writes nor refuses them: {open_}"
    )


# a family's other shapes, each read back and run in llama.cpp as mlx-lm runs it
VARIANTS = {
    # EXAONE 4.0 32B's: local layers (roped, windowed) and global ones (unroped), which
    # llama.cpp's exaone4 reads at 64 layers; the window shorter than the ids
    "exaone4-64": (
        "exaone4",
        {"num_hidden_layers": 64, "sliding_window_pattern": "LLLG", "sliding_window": 4},
    ),
    # a tied MiniCPM3 (mlx-lm leaves its logits unscaled, llama.cpp scales them)
    "minicpm3-tied": ("minicpm3", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_familys_other_shapes_read_back_and_run_in_llama_cpp(
    variant, tmp_path, tokenizer, tokenizer_dir
):
    name, change = VARIANTS[variant]
    saved = FAMILIES[name]
    FAMILIES[name] = {**saved, **change}
    try:
        model, config = tiny(name, len(tokenizer._tokenizer))
    finally:
        FAMILIES[name] = saved
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    want = np.array(model(mx.array([IDS]))[0])
    back, _, _ = load_gguf(path, "float32")
    np.testing.assert_allclose(np.array(back(mx.array([IDS]))[0]), want, rtol=1e-5, atol=1e-5)
    assert_llama_cpps_logits(path, IDS, want)


def adapted(name, vocab):
    """The tiny model with LoRA on every linear layer but a mixture's experts, its B random."""
    from mlx.utils import tree_unflatten

    from mlxtune.adapters import LoRALinear, LoRASwitchLinear, apply_adapters

    model, config = tiny(name, vocab)
    moe = any("switch_mlp" in p or ".experts." in p for p, _ in tree_flatten(model.parameters()))
    present = {p.rsplit(".", 1)[-1] for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    beside_experts = [
        "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "in_proj", "in_proj_qkvz",
        "input_linear",  # Granite's shared MLP
        "query_key_value", "dense",  # Ling's
        "Wqkv",  # DBRX's
    ]  # fmt: skip
    targets = [n for n in beside_experts if n in present] if moe else ["all-linear"]
    # llama.cpp's deepseek2 applies no adapter to multi-head latent attention's projections
    mla = {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    if "kv_a_proj_with_mqa" in present:
        targets = sorted((set(targets) if moe else present) - mla - {"lm_head"})
    if name == "kimi_linear":  # llama.cpp applies adapters to its MLPs (and MLA's output) only
        targets = ["gate_proj", "up_proj", "down_proj"]
    apply_adapters(model, "lora", 4, 8.0, 0.0, targets)
    experts = [(p, m.linear) for p, m in model.named_modules() if isinstance(m, LoRASwitchLinear)]
    if experts and name == "kimi_linear":  # the experts' projections share those names
        model.update_modules(tree_unflatten(experts))
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.lora_b = 0.2 * mx.random.normal(m.lora_b.shape)
    return model, config


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_applies_the_gguf_adapter_of_each_family(
    name, tmp_path, tokenizer, tokenizer_dir
):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    from mlxtune.export.gguf.write import write_gguf_adapter

    plain, config = tiny(name, len(tokenizer._tokenizer))  # the same base: the same seed
    base = write_gguf_model(plain, config, tokenizer, tokenizer_dir, tmp_path, "f32", name)
    model, config = adapted(name, len(tokenizer._tokenizer))
    lora = write_gguf_adapter(model, config, 8.0, tmp_path)
    want = np.array(model(mx.array([IDS]))[0])
    assert_llama_cpps_logits(base, IDS, want, lora_path=str(lora))


def test_a_gguf_adapter_where_llama_cpp_applies_none_is_refused_by_name(tmp_path, tokenizer):
    from mlxtune.adapters import apply_adapters
    from mlxtune.export.gguf.write import write_gguf_adapter

    for name, target in (("youtu_llm", "kv_b_proj"), ("deepseek_v3", "q_a_proj")):
        model, config = tiny(name, len(tokenizer._tokenizer))
        apply_adapters(model, "lora", 4, 8.0, 0.0, [target])
        with pytest.raises(UserInputError, match=f"{target} is attn_.* without applying LoRA"):
            write_gguf_adapter(model, config, 8.0, tmp_path)
    assert not list(tmp_path.glob("*.gguf"))


def test_a_gguf_adapter_of_expert_adapters_is_refused_by_name(tmp_path, tokenizer):
    from mlxtune.adapters import apply_adapters
    from mlxtune.export.gguf.write import write_gguf_adapter

    model, config = tiny("qwen3_moe", len(tokenizer._tokenizer))
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    with pytest.raises(UserInputError, match="switch_mlp.* experts"):
        write_gguf_adapter(model, config, 8.0, tmp_path)


@pytest.mark.parametrize("name", ["qwen3_moe", "lfm2"])
def test_a_gguf_file_of_a_newer_family_is_a_training_base(
    name, tmp_path, data_dir, tokenizer, tokenizer_dir
):
    """LoRA over the Q8_0 file of a mixture of experts and of a hybrid: the loss falls, and the
    run's own GGUF export holds the trained model (read back to its logits)."""
    import json

    from test_gguf_run import recipe
    from test_resume import trainer

    model, config = tiny(name, len(tokenizer._tokenizer))
    (tmp_path / "base").mkdir()
    base = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path / "base", "q8_0")
    r = recipe(data_dir, base)
    r["train"]["max_steps"] = 12
    r["export"] = {"formats": ["gguf"]}
    tr = trainer(r, tmp_path / "run")
    tr.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row and "eval_loss" not in row]
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < losses[0]
    tr.model.eval()
    ids = mx.array([tr.train_set.examples[0].ids])
    want = np.array(tr.model(ids)[0].astype(mx.float32))
    out = next((tmp_path / "run" / "export" / "gguf").glob("*.gguf"))
    back, back_config, _ = load_gguf(out, "float32")
    assert back_config["model_type"] == name
    # the export is f16: its rounding, not the training, sets the tolerance
    np.testing.assert_allclose(np.array(back(ids)[0]), want, atol=3e-2 * np.abs(want).max())


SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"type": "linear", "factor": 4.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
}


def test_llama3_rope_divisors_are_mlx_lms_and_read_back_to_the_same():
    from mlx_lm.models.rope_utils import Llama3RoPE

    from mlxtune.gguf.rope import llama3_rope_factors, llama3_settings

    for base, dim, old in ((500000.0, 128, 8192), (10000.0, 16, 32), (10000.0, 64, 512)):
        scaling = {**SCALINGS["llama3"], "original_max_position_embeddings": old}
        rope = Llama3RoPE(dim, 2048, False, base, scaling_config=scaling)
        plain = base ** (np.arange(0, dim, 2) / dim)
        want = np.array(rope._freqs) / plain
        got = llama3_rope_factors(base, dim, scaling)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        back = llama3_settings(got, base, dim)
        assert back is not None
        np.testing.assert_allclose(llama3_rope_factors(base, dim, back), got, rtol=1e-5)
    assert llama3_settings(np.linspace(1, 3, 8), 10000.0, 16) is None  # not Llama 3's shape


def scaled_llama(vocab, kind):
    mx.random.seed(6)
    config = {**tiny_config("llama", vocab), "rope_scaling": SCALINGS.get(kind)}
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(config))
    params = tree_flatten(model.parameters())  # livelier than the init: the positions show
    model.load_weights([(k, v * 4 if v.ndim == 2 else v) for k, v in params])
    return model, config


ROPE_IDS = list(range(1, 41))  # past the original context of the test's Llama 3 scaling


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_scaling_is_written_to_gguf_and_read_back(kind, tmp_path, tokenizer, tokenizer_dir):
    model, config = scaled_llama(len(tokenizer._tokenizer), kind)
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    want = np.array(model(mx.array([ROPE_IDS]))[0])
    unscaled, _ = scaled_llama(len(tokenizer._tokenizer), None)
    assert np.abs(np.array(unscaled(mx.array([ROPE_IDS]))[0]) - want).max() > 1e-2
    back, back_config, _ = load_gguf(path, "float32")
    np.testing.assert_allclose(np.array(back(mx.array([ROPE_IDS]))[0]), want, atol=1e-4)
    scaling = back_config["rope_scaling"]
    assert (scaling.get("rope_type") or scaling.get("type")) == kind


# a family of each llama.cpp architecture (besides llama's) whose graph reads ``rope_freqs``
LLAMA3_FAMILIES = ["apertus", "nemotron-nas", "exaone", "exaone4", "exaone_moe"]
LLAMA3_FAMILIES += ["granite", "granitemoe", "minicpm"]


@pytest.mark.parametrize("name", LLAMA3_FAMILIES)
def test_llama3_rope_scaling_round_trips_in_each_architecture_reading_rope_freqs(
    name, tmp_path, tokenizer, tokenizer_dir
):
    """Llama 3's scaling written as the rope_freqs tensor and read back from it wherever
    llama.cpp's graph divides the frequencies by it (Apertus' own configs set it)."""
    from mlxtune.gguf.names import FAMILIES as ARCHS
    from mlxtune.gguf.rope import LLAMA3_ROPE_ARCHS

    assert {ARCHS[n].arch for n in LLAMA3_FAMILIES} == LLAMA3_ROPE_ARCHS - {"llama", "llama4"}
    model, config = llama3_scaled(name, len(tokenizer._tokenizer))
    ids = mx.array([ROPE_IDS])
    want = np.array(model(ids)[0])
    unscaled = model_class_without_scaling(model, config)
    assert np.abs(np.array(unscaled(ids)[0]) - want).max() > 1e-3  # the scaling shows
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32", name)
    f, t, _ = read(path)
    assert "rope_freqs.weight" in t
    back, back_config, _ = load_gguf(path, "float32")
    assert back_config["rope_scaling"]["rope_type"] == "llama3"
    np.testing.assert_allclose(np.array(back(ids)[0]), want, atol=1e-4 * max(1, np.abs(want).max()))


def llama3_scaled(name, vocab):
    FAMILIES[name] = {**FAMILIES[name], "rope_scaling": SCALINGS["llama3"]}
    try:
        return tiny(name, vocab)
    finally:
        FAMILIES[name] = {k: v for k, v in FAMILIES[name].items() if k != "rope_scaling"}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", LLAMA3_FAMILIES)
def test_llama_cpp_runs_llama3_scaling_from_rope_freqs_as_mlx_lm(
    name, tmp_path, tokenizer, tokenizer_dir
):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    model, config = llama3_scaled(name, len(tokenizer._tokenizer))
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32", name)
    want = np.array(model(mx.array([ROPE_IDS]))[0])
    assert_llama_cpps_logits(path, ROPE_IDS, want)


def model_class_without_scaling(model, config):
    """``model``'s weights in a model of ``config`` without its rope scaling."""
    plain = {**config, "rope_scaling": None}
    model_class, args_class = family_classes(plain)
    out = model_class(args_class.from_dict(normalise_config(plain, args_class)))
    out.load_weights(tree_flatten(model.parameters()))
    return out


@pytest.mark.llama_cpp
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_llama_cpp_runs_a_scaled_rope_as_mlx_lm(kind, tmp_path, tokenizer, tokenizer_dir):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    model, config = scaled_llama(len(tokenizer._tokenizer), kind)
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    want = np.array(model(mx.array([ROPE_IDS]))[0])
    assert_llama_cpps_logits(path, ROPE_IDS, want)


def test_a_rope_scaling_gguf_export_cannot_hold_is_refused_by_name(
    tmp_path, tokenizer, tokenizer_dir
):
    yarn = {**SCALINGS["yarn"], "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek's
    config = {**tiny_config("qwen2", len(tokenizer._tokenizer)), "rope_scaling": yarn}
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(config))
    with pytest.raises(UserInputError, match="RoPE scaling 'yarn' of a qwen2 model"):
        write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    model, config = llama3_scaled("falcon_h1", len(tokenizer._tokenizer))  # its graph: no divisors
    with pytest.raises(UserInputError, match="RoPE scaling 'llama3' of a falcon_h1 model"):
        write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
    betas = {**SCALINGS["yarn"], "beta_fast": 16.0}  # llama.cpp's qwen2 keeps 32
    config = {**tiny_config("qwen2", len(tokenizer._tokenizer)), "rope_scaling": betas}
    model = model_class(args_class.from_dict(config))
    with pytest.raises(UserInputError, match="reads no yarn betas"):
        write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path, "f32")
