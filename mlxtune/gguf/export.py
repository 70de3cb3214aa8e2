"""GGUF, written natively with the ``gguf`` package (llama.cpp's own reader/writer; no llama.cpp
build and no torch needed).

- ``write_gguf_model``: the fused model in f32, f16, bf16 or q8_0, with the tokenizer's
  vocabulary, scores, token types and special tokens as llama.cpp expects them.
- ``write_gguf_adapter``: a LoRA adapter for llama.cpp's ``--lora``: general.type = adapter,
  adapter.type = lora, adapter.lora.alpha, tensors ``blk.N.<name>.weight.lora_a`` [r, in] and
  ``.lora_b`` [out, r] (numpy order).

llama-family models store q/k in Hugging Face's rotate-half layout; llama.cpp's converter
permutes their rows to the interleaved layout its rope uses, so the same permutation is applied
here (to q/k weights, and to the rows of LoRA B for q/k). Every file is read back and checked
(architecture, metadata, tensor names and shapes) before the export counts as written.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..adapters import DoRALinear, LoRALinear, LoRASwitchLinear
from ..errors import UserInputError
from ..models.configs import rope_base
from .file import open_gguf
from .names import DTYPES, FAMILIES, SHARED_GATE_UP, gguf_name, llama_cpp_arch
from .rope import llama3_rope_factors
from .tokenizer import EXPORT_PRE_NAMES


def _arch(config: dict) -> tuple[str, bool]:
    mt = config.get("model_type")
    if mt not in FAMILIES:
        arch = llama_cpp_arch(str(mt))
        why = (
            f"llama.cpp has no architecture for {mt!r}"
            if arch is None
            else f"llama.cpp's {arch!r} architecture is not one mlxtune writes yet"
        )
        raise UserInputError(
            f"{why}; GGUF export writes {', '.join(FAMILIES)}", "export --format gguf"
        )
    return FAMILIES[mt].arch, FAMILIES[mt].permuted


def _args(model):
    return getattr(model, "args", None)


def text_part(model, config: dict):
    """(language model, its config) of a multimodal wrapper that mlx-lm builds around one
    (Gemma 3 and 4, Qwen3.5, Mistral 3: ``language_model`` under ``text_config``); the model
    and config themselves otherwise. GGUF holds the language model; a vision tower goes to
    llama.cpp's separate projector file, which mlxtune does not write."""
    text = config.get("text_config")
    inner = getattr(model, "language_model", None)
    if isinstance(text, dict) and isinstance(inner, nn.Module):
        return inner, {**text, "model_type": text.get("model_type", config.get("model_type"))}
    return model, config


def _refusal(model, config: dict) -> str | None:
    """What llama.cpp fixes for the architecture that this model does otherwise (None: none).
    llama.cpp's graphs hard-code some settings per architecture instead of reading them."""
    mt, args = config["model_type"], _args(model)
    family = FAMILIES[mt]

    def arg(name, default=None):
        return getattr(args, name, config.get(name, default))

    if family.norm_topk is not None:
        norm = arg("norm_topk_prob", True if mt in ("mixtral", "granitemoe") else None)
        if norm is not None and bool(norm) != family.norm_topk:
            return (
                f"llama.cpp's {family.arch} {'re' if family.norm_topk else 'does not re'}"
                f"normalise the routers' top-k weights; this model's norm_topk_prob is {norm}"
            )
        if arg("mlp_only_layers") or arg("decoder_sparse_step", 1) != 1:
            return f"llama.cpp's {family.arch} puts experts in every layer; this model does not"
    if mt == "gemma3_text":
        head_dim = arg("head_dim")
        checks = (
            ("sliding_window_pattern", 6),
            ("rope_local_base_freq", 10000.0),
            ("query_pre_attn_scalar", head_dim),
        )
        for key, fixed in checks:
            if arg(key) is not None and float(arg(key)) != float(fixed):
                return f"llama.cpp's gemma3 fixes {key} at {fixed:g}; this model's is {arg(key):g}"
    if mt == "smollm3":
        layers = arg("no_rope_layers")
        every4 = [int((i + 1) % 4 != 0) for i in range(arg("num_hidden_layers"))]
        if layers is not None and list(layers) != every4:
            return "llama.cpp's smollm3 leaves RoPE out of every 4th layer; this model does not"
    if mt == "olmoe" and (arg("num_key_value_heads") or arg("num_attention_heads")) != arg(
        "num_attention_heads"
    ):
        return (
            "llama.cpp's olmoe normalises keys over all heads at once, so it reads models with "
            "as many key/value heads as query heads; this model has fewer"
        )
    if mt == "ministral3":
        rp = arg("rope_parameters") or {}
        if arg("sliding_window") is not None:
            return (
                "llama.cpp's mistral3 attends over the whole context; this model's config sets "
                "a sliding_window"
            )
        if rp.get("mscale", rp.get("mscale_all_dim")) != rp.get("mscale_all_dim"):
            return "llama.cpp's mistral3 reads one yarn mscale; this model's two differ"
    if mt == "nemotron_h":
        pattern = _nemotron_h_pattern(args)
        if set(pattern) - set("M*E"):
            return (
                "mlxtune writes Nemotron-H's mixture-of-experts form (Mamba, attention and "
                "expert layers); this model has dense MLP layers"
            )
        if float((arg("time_step_limit") or [0.0])[0]) > 0.0:
            return "llama.cpp's nemotron_h does not clamp the SSM step from below; this model does"
    if mt == "nemotron" and arg("hidden_act", "relu2") != "relu2":
        return (
            f"llama.cpp's nemotron squares a ReLU; this model's activation is {arg('hidden_act')}"
        )
    if mt in ("mamba2", "granitemoehybrid") and float((arg("time_step_limit") or [0.0])[0]) > 0:
        return "llama.cpp's mamba2 does not clamp the SSM step from below; this model does"
    if mt == "gemma4_text":
        full = (arg("rope_parameters") or {}).get("full_attention", {})
        if arg("enable_moe_block") or arg("attention_k_eq_v"):
            return "mlxtune writes Gemma 4's dense models to GGUF, not its experts or k = v form"
        if full.get("rope_type", "proportional") != "proportional":
            return "llama.cpp's gemma4 rotates full layers proportionally; this model does not"
    if mt == "gpt_oss":
        types = list(arg("layer_types") or [])
        alternate = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))
        ]
        if types != alternate:
            return (
                "llama.cpp's gpt-oss slides the window on even layers and attends fully on odd "
                "ones; this model's layer_types differ"
            )
    if mt == "lfm2_moe" and (
        float(arg("routed_scaling_factor", 1.0)) != 1.0 or not arg("use_expert_bias", True)
    ):
        return (
            "llama.cpp's lfm2moe mixes experts by their sigmoid weights with the expert bias, "
            "unscaled; this model scales them or has no expert bias"
        )
    if mt in ("lfm2", "lfm2_moe") and int(arg("conv_L_cache", 0)) < 2:
        return "llama.cpp's lfm2 needs a short convolution of at least 2 taps"
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from rotate-half to interleaved order (llama.cpp's convention)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _heads(config: dict) -> tuple[int, int, int]:
    if "num_attention_heads" not in config:  # an attention-free model (Mamba 2)
        return 0, 0, 0
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    return n_head, n_kv, head_dim


def _tensor_array(a: np.ndarray, dtype: str):
    """(numpy data, raw dtype or None) for GGUFWriter.add_tensor, from an fp32 array."""
    import gguf

    if dtype == "f32" or a.ndim == 1:  # norms and biases stay f32, as llama.cpp's converter does
        return a, None
    if dtype == "f16":
        return a.astype(np.float16), None
    if dtype == "bf16":
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16)
        return q, gguf.GGMLQuantizationType.BF16
    if a.shape[-1] % 32:  # q8_0 packs 32 values per block
        return a.astype(np.float16), None
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


# Split patterns of byte-level BPE pre-tokenizers -> the names llama.cpp knows them by (the
# table GGUF import reads them back with, so that export and import agree)
_PRE_PATTERNS = EXPORT_PRE_NAMES


def _bpe_pre_name(data: dict) -> str:
    """llama.cpp's name for a tokenizer.json's pre-tokenizer (UserInputError when unknown)."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    split = next((s for s in steps if s.get("type") == "Split"), None)
    level = next((s for s in steps if s.get("type") == "ByteLevel"), None)
    if split is None and level is not None and level.get("use_regex", True):
        return "gpt-2"
    pattern = split.get("pattern", {}).get("Regex") if split else None
    if pattern in _PRE_PATTERNS:
        return _PRE_PATTERNS[pattern]
    raise UserInputError(
        "this BPE tokenizer's pre-tokenizer is not one llama.cpp knows (GPT-2, Qwen2, Llama 3 are)",
        "export --format gguf",
    )


def _add_bpe_tokenizer(w, tokenizer):
    """A byte-level BPE vocabulary (tokenizer.json) as llama.cpp's "gpt2" tokenizer model."""
    import json

    import gguf

    fast = tokenizer._tokenizer
    data = json.loads(fast.backend_tokenizer.to_str())
    model = data["model"]
    n = len(fast)
    tokens: list[str | None] = [None] * n
    types = [int(gguf.TokenType.NORMAL)] * n
    for tok, i in model["vocab"].items():
        tokens[i] = tok
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(
            gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        )
    for i, tok in enumerate(tokens):  # holes in the ids, filled as llama.cpp's converter fills them
        if tok is None:
            tokens[i], types[i] = f"[PAD{i}]", int(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_bpe_pre_name(data))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key in ("bos", "eos", "unk", "pad"):
        tid = getattr(fast, f"{key}_token_id", None)
        if tid is not None:
            getattr(w, f"add_{key}_token_id")(tid)
    # whether BOS/EOS are added shows in what the tokenizer does (its post-processor), which a
    # tokenizer_config.json flag need not mirror
    plain, full = fast.encode("a", add_special_tokens=False), fast.encode("a")
    bos, eos = fast.bos_token_id, fast.eos_token_id
    w.add_add_bos_token(bos is not None and len(full) > len(plain) and full[0] == bos)
    w.add_add_eos_token(eos is not None and len(full) > len(plain) and full[-1] == eos)
    template = getattr(fast, "chat_template", None)
    if isinstance(template, str):
        w.add_chat_template(template)


def _is_bpe(tokenizer) -> bool:
    backend = getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    return backend is not None and type(backend.model).__name__ == "BPE"


def _add_tokenizer(w, tokenizer_dir: Path | None, tokenizer):
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    spm_path = tokenizer_dir / "tokenizer.model" if tokenizer_dir else None
    if spm_path is None or not spm_path.exists():
        if _is_bpe(tokenizer):
            return _add_bpe_tokenizer(w, tokenizer)
        raise UserInputError(
            "GGUF export needs a sentencepiece tokenizer.model or a BPE tokenizer.json",
            "export --format gguf",
        )
    proto = pb.ModelProto()
    proto.ParseFromString(spm_path.read_bytes())
    types = {
        pb.ModelProto.SentencePiece.NORMAL: gguf.TokenType.NORMAL,
        pb.ModelProto.SentencePiece.UNKNOWN: gguf.TokenType.UNKNOWN,
        pb.ModelProto.SentencePiece.CONTROL: gguf.TokenType.CONTROL,
        pb.ModelProto.SentencePiece.USER_DEFINED: gguf.TokenType.USER_DEFINED,
        pb.ModelProto.SentencePiece.UNUSED: gguf.TokenType.UNUSED,
        pb.ModelProto.SentencePiece.BYTE: gguf.TokenType.BYTE,
    }
    if proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM:
        # llama.cpp's "llama" tokenizer merges pieces by score (sentencepiece BPE); a unigram
        # model needs its Viterbi tokenizer ("t5", UGM) and the normaliser's character map.
        w.add_tokenizer_model("t5")
        w.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
        w.add_remove_extra_whitespaces(bool(proto.normalizer_spec.remove_extra_whitespaces))
    else:
        w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([p.piece.encode("utf-8") for p in proto.pieces])
    w.add_token_scores([float(p.score) for p in proto.pieces])
    w.add_token_types([int(types[p.type]) for p in proto.pieces])
    spec = proto.trainer_spec
    for key, tid in (
        ("bos", spec.bos_id),
        ("eos", spec.eos_id),
        ("unk", spec.unk_id),
        ("pad", spec.pad_id),
    ):
        if tid >= 0:
            getattr(w, f"add_{key}_token_id")(tid)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(bool(proto.normalizer_spec.add_dummy_prefix))
    template = (
        getattr(tokenizer._tokenizer, "chat_template", None) if tokenizer is not None else None
    )
    if isinstance(template, str):
        w.add_chat_template(template)


def _copy_tokenizer(w, source: Path, template: str | None):
    """Every ``tokenizer.*`` field of a GGUF file, as it is there (a GGUF base's own
    vocabulary, which llama.cpp reads back exactly), with ``template`` as the chat template
    when one is given."""
    import gguf

    f = open_gguf(source)
    for key, value in f.fields.items():
        if not key.startswith("tokenizer.") or (
            key == "tokenizer.chat_template" and template is not None
        ):
            continue
        vtype, sub = f.types[key]
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(value) == 0:
                continue
            value = value.tolist() if isinstance(value, np.ndarray) else value
            w.add_key_value(key, value, gguf.GGUFValueType(vtype), gguf.GGUFValueType(sub))
        else:
            w.add_key_value(key, value, gguf.GGUFValueType(vtype))
    if template is not None:
        w.add_chat_template(template)


def _add_hparams(w, config: dict, model=None):
    import gguf

    mt, args = config["model_type"], _args(model)

    def arg(name, default=None):
        v = getattr(args, name, None)
        return config.get(name, default) if v is None else v

    n_head, n_kv, head_dim = _heads(config)
    layers = config["num_hidden_layers"]
    if mt == "mamba2":
        return _add_mamba2(w, args)
    if FAMILIES[mt].arch == "deepseek2":
        return _add_mla(w, args)
    if mt == "nemotron_h":
        return _add_nemotron_h(w, args)
    if mt == "granitemoehybrid":
        _add_granite_hybrid(w, args)
    if mt == "gemma2":
        w.add_attn_logit_softcapping(float(arg("attn_logit_softcapping", 50.0)))
        w.add_final_logit_softcapping(float(arg("final_logit_softcapping", 30.0)))
        w.add_sliding_window(int(config.get("sliding_window") or 4096))
    if mt == "gpt_oss":
        w.add_sliding_window(int(arg("sliding_window")))
        w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    if mt == "olmo3":  # OLMo 3: OLMo 2 with a window on the layer_types' sliding layers
        w.add_sliding_window(int(arg("sliding_window")))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in arg("layer_types")])
    if mt == "gemma3_text":
        w.add_sliding_window(int(arg("sliding_window")))
        if arg("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(arg("final_logit_softcapping")))
    w.add_context_length(int(config.get("max_position_embeddings") or 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(layers)
    w.add_head_count(n_head)
    w.add_layer_norm_rms_eps(float(arg("rms_norm_eps") or arg("norm_eps") or 1e-5))
    w.add_vocab_size(config["vocab_size"])
    if mt == "gemma4_text":
        return _add_gemma4(w, args)
    w.add_feed_forward_length(_ffn_width(model, config))
    if mt == "granitemoehybrid":  # a layer with no kv heads is a Mamba layer
        types = arg("layer_types")
        w.add_head_count_kv([n_kv if t == "attention" else 0 for t in types])
    elif mt in ("lfm2", "lfm2_moe"):  # a layer with no kv heads is a short-convolution layer
        full = set(arg("full_attn_idxs") or [])
        w.add_head_count_kv([n_kv if i in full else 0 for i in range(layers)])
        w.add_shortconv_l_cache(int(arg("conv_L_cache")))
        if mt == "lfm2_moe":
            w.add_leading_dense_block_count(int(arg("num_dense_layers")))
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:
        w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(int(head_dim * float(arg("partial_rotary_factor") or 1.0)))
    theta = getattr(args, "rope_theta", None)  # as the model was built (config normalised)
    w.add_rope_freq_base(float(theta) if theta is not None else rope_base(config))
    if config.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = (
        arg("num_experts")
        or arg("num_local_experts")
        or arg("n_routed_experts")
        or arg("moe_num_experts")
    )
    if experts:
        w.add_expert_count(int(experts))
        w.add_expert_used_count(int(arg("num_experts_per_tok")))
        if arg("moe_intermediate_size"):
            w.add_expert_feed_forward_length(int(arg("moe_intermediate_size")))
        if arg("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(int(arg("shared_expert_intermediate_size")))
    if mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):  # gated delta-net layers
        w.add_ssm_conv_kernel(int(arg("linear_conv_kernel_dim")))
        w.add_ssm_state_size(int(arg("linear_key_head_dim")))
        w.add_ssm_group_count(int(arg("linear_num_key_heads")))
        w.add_ssm_time_step_rank(int(arg("linear_num_value_heads")))
        w.add_ssm_inner_size(int(arg("linear_value_head_dim") * arg("linear_num_value_heads")))
        w.add_full_attention_interval(int(arg("full_attention_interval")))
        if mt != "qwen3_next":  # multimodal RoPE sections (text positions: any split is one)
            rp = arg("rope_parameters") or {}
            rot = int(head_dim * float(arg("partial_rotary_factor") or 1.0)) // 2
            sections = list(rp.get("mrope_section") or [rot])
            w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    eps = arg("layer_norm_eps") or arg("norm_epsilon") or arg("layer_norm_epsilon")
    if mt == "nemotron":  # its LayerNorm epsilon goes by norm_eps
        eps = arg("norm_eps")
    if eps is not None:  # a LayerNorm family (StableLM, StarCoder2, Nemotron)
        w.add_layer_norm_eps(float(eps))
    if experts and mt != "glm4_moe":  # DeepSeek-style shared experts and leading dense blocks
        if arg("n_shared_experts") is not None:
            w.add_expert_shared_count(int(arg("n_shared_experts")))
        if arg("first_k_dense_replace") is not None:
            w.add_leading_dense_block_count(int(arg("first_k_dense_replace")))
    if mt == "glm4_moe":  # sigmoid routing with a correction bias, grouped, scaled, renormed
        w.add_expert_shared_count(int(arg("n_shared_experts") or 0))
        w.add_leading_dense_block_count(int(arg("first_k_dense_replace") or 0))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(float(arg("routed_scaling_factor") or 1.0))
        w.add_expert_weights_norm(bool(arg("norm_topk_prob")))
        w.add_expert_group_count(int(arg("n_group") or 1))
        w.add_expert_group_used_count(int(arg("topk_group") or 1))
        w.add_nextn_predict_layers(0)  # mlx-lm keeps no multi-token-prediction layer
    if mt == "minicpm":  # muP-style scales: embeddings, each residual branch, the logits
        w.add_embedding_scale(float(arg("scale_emb")))
        w.add_residual_scale(float(arg("scale_depth")) / layers**0.5)
        w.add_logit_scale(float(arg("hidden_size")) / float(arg("dim_model_base")))
    if mt in ("granite", "granitemoe", "granitemoehybrid"):  # every one: some builds need all
        w.add_attention_scale(float(arg("attention_multiplier")))
        w.add_embedding_scale(float(arg("embedding_multiplier")))
        w.add_residual_scale(float(arg("residual_multiplier")))
        w.add_logit_scale(float(arg("logits_scaling")))


def _add_mla(w, args) -> None:
    """DeepSeek-V3's multi-head latent attention and routing as llama.cpp's deepseek2 reads
    them: one latent kv head of kv_lora_rank + the rotary part, decompressed per head."""
    import gguf

    layers = int(args.num_hidden_layers)
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(layers)
    w.add_feed_forward_length(int(args.intermediate_size))
    w.add_head_count(int(args.num_attention_heads))
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    w.add_vocab_size(int(args.vocab_size))
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_rope_dimension_count(int(args.qk_rope_head_dim))
    w.add_leading_dense_block_count(int(args.first_k_dense_replace))
    if args.q_lora_rank is not None:
        w.add_q_lora_rank(int(args.q_lora_rank))
    w.add_kv_lora_rank(int(args.kv_lora_rank))
    w.add_key_length(int(args.kv_lora_rank + args.qk_rope_head_dim))
    w.add_value_length(int(args.kv_lora_rank))
    w.add_key_length_mla(int(args.qk_nope_head_dim + args.qk_rope_head_dim))
    w.add_value_length_mla(int(args.v_head_dim))
    w.add_expert_feed_forward_length(int(args.moe_intermediate_size))
    w.add_expert_count(int(args.n_routed_experts))
    w.add_expert_used_count(int(args.num_experts_per_tok))
    w.add_expert_shared_count(int(args.n_shared_experts or 0))
    w.add_expert_weights_scale(float(getattr(args, "routed_scaling_factor", 1.0)))
    if getattr(args, "norm_topk_prob", False):
        w.add_expert_weights_norm(True)
    sigmoid = getattr(args, "scoring_func", "softmax") == "sigmoid"  # DeepSeek-V2: softmax
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
    w.add_expert_group_count(int(getattr(args, "n_group", None) or 1))
    w.add_expert_group_used_count(int(getattr(args, "topk_group", None) or 1))


def _nemotron_h_pattern(args) -> str:
    pattern = args.hybrid_override_pattern
    return pattern if isinstance(pattern, str) else "".join(pattern)


def _add_nemotron_h(w, args) -> None:
    """Nemotron-H as llama.cpp's nemotron_h_moe reads it: Mamba 2 layers (M), attention layers
    without RoPE (*) and expert layers (E), each kind's widths in per-layer arrays."""
    import gguf

    pattern = _nemotron_h_pattern(args)
    layers = len(pattern)
    w.add_context_length(int(args.max_position_embeddings))
    w.add_embedding_length(int(args.hidden_size))
    w.add_block_count(layers)
    w.add_head_count(int(args.num_attention_heads))
    w.add_head_count_kv([int(args.num_key_value_heads) if c == "*" else 0 for c in pattern])
    w.add_key_length(int(args.head_dim))
    w.add_value_length(int(args.head_dim))
    w.add_layer_norm_rms_eps(float(args.layer_norm_epsilon))
    w.add_layer_norm_eps(float(args.layer_norm_epsilon))  # the loader reads both
    w.add_vocab_size(int(args.vocab_size))
    w.add_rope_scaling_finetuned(False)  # no RoPE in the attention layers
    w.add_ssm_conv_kernel(int(args.conv_kernel))
    w.add_ssm_state_size(int(args.ssm_state_size))
    w.add_ssm_group_count(int(args.n_groups))
    w.add_ssm_inner_size(int(args.mamba_num_heads * args.mamba_head_dim))
    w.add_ssm_time_step_rank(int(args.mamba_num_heads))
    ff = int(args.moe_intermediate_size)
    w.add_feed_forward_length([ff if c == "E" else 0 for c in pattern])
    w.add_expert_count(int(args.n_routed_experts))
    w.add_expert_used_count(int(args.num_experts_per_tok))
    w.add_expert_feed_forward_length(ff)
    w.add_expert_shared_feed_forward_length(int(args.moe_shared_expert_intermediate_size))
    w.add_expert_shared_count(int(args.n_shared_experts or 0))
    w.add_expert_weights_norm(bool(args.norm_topk_prob))
    w.add_expert_weights_scale(float(args.routed_scaling_factor or 1.0))
    w.add_expert_group_count(int(args.n_group or 1))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _add_granite_hybrid(w, args) -> None:
    """Granite 4's hybrids as llama.cpp's granitehybrid reads them: Mamba 2 layers beside the
    attention layers (kv heads per layer, 0 for Mamba), RoPE only where the model uses it."""
    w.add_ssm_conv_kernel(int(args.mamba_d_conv))
    w.add_ssm_state_size(int(args.mamba_d_state))
    w.add_ssm_group_count(int(args.mamba_n_groups))
    w.add_ssm_inner_size(int(args.mamba_n_heads * args.mamba_d_head))
    w.add_ssm_time_step_rank(int(args.mamba_n_heads))
    w.add_rope_scaling_finetuned(getattr(args, "position_embedding_type", "rope") == "rope")
    if args.shared_intermediate_size:
        w.add_expert_shared_feed_forward_length(int(args.shared_intermediate_size))


def _add_mamba2(w, args) -> None:
    """Mamba 2 as llama.cpp's mamba2 reads it (no attention: zero heads, no MLP)."""
    w.add_context_length(int(getattr(args, "max_position_embeddings", None) or 2**20))
    w.add_embedding_length(int(args.hidden_size))
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(int(args.num_hidden_layers))
    w.add_ssm_conv_kernel(int(args.conv_kernel))
    w.add_ssm_inner_size(int(args.intermediate_size))
    w.add_ssm_state_size(int(args.state_size))
    w.add_ssm_time_step_rank(int(args.num_heads))
    w.add_ssm_group_count(int(args.n_groups))
    w.add_layer_norm_rms_eps(float(args.layer_norm_epsilon))
    w.add_vocab_size(int(args.vocab_size))


def _ssm_tensor(a: np.ndarray, g: str, args) -> np.ndarray:
    """A Mamba 2 tensor as llama.cpp's converter writes it: A as -exp(A_log) and D as columns
    [heads, 1], the gated norm per group [groups, inner / groups]."""
    if g.endswith(".ssm_a"):
        return -np.exp(a).reshape(-1, 1)
    if g.endswith(".ssm_d"):
        return a.reshape(-1, 1)
    if g.endswith("ssm_norm.weight"):
        groups = getattr(args, "n_groups", None) or getattr(args, "mamba_n_groups", 1)
        return a.reshape(int(groups), -1)
    return a


def _add_gemma4(w, args) -> None:
    """Gemma 4's layout as llama.cpp's gemma4 reads it: full layers with their own head size,
    kv heads and a partial ("proportional") rotation base, sliding ones with theirs; the last
    num_kv_shared_layers reading earlier layers' keys, their MLP twice as wide."""
    layers = args.num_hidden_layers
    sliding = [t == "sliding_attention" for t in args.layer_types]
    full_rope = args.rope_parameters.get("full_attention", {})
    swa_rope = args.rope_parameters.get("sliding_attention", {})
    w.add_sliding_window(int(args.sliding_window))
    if args.final_logit_softcapping:
        w.add_final_logit_softcapping(float(args.final_logit_softcapping))
    w.add_shared_kv_layers(int(args.num_kv_shared_layers))
    w.add_embedding_length_per_layer_input(int(args.hidden_size_per_layer_input or 0))
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(int(args.global_head_dim))
    w.add_value_length(int(args.global_head_dim))
    w.add_key_length_swa(int(args.head_dim))
    w.add_value_length_swa(int(args.head_dim))
    shared_from = layers - int(args.num_kv_shared_layers)
    ff = int(args.intermediate_size)
    wide = [ff if i < shared_from else 2 * ff for i in range(layers)]
    w.add_feed_forward_length(wide if args.use_double_wide_mlp else ff)
    kv, kv_full = int(args.num_key_value_heads), args.num_global_key_value_heads
    w.add_head_count_kv([kv if s else int(kv_full) for s in sliding] if kv_full else kv)
    w.add_rope_dimension_count(int(args.global_head_dim))
    swa_dims = args.head_dim * float(swa_rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count_swa(int(swa_dims))
    w.add_rope_freq_base(float(full_rope.get("rope_theta", 1e6)))
    w.add_rope_freq_base_swa(float(swa_rope.get("rope_theta", 1e4)))


def _gemma4_rope_freqs(args) -> np.ndarray:
    """The full layers' "proportional" RoPE as llama.cpp's converter writes it: the rotated
    share of each head's frequency pairs as they are, the rest divided by 1e30 (unrotated)."""
    full = args.rope_parameters.get("full_attention", {})
    pairs = int(args.global_head_dim) // 2
    rotated = int(args.global_head_dim * float(full.get("partial_rotary_factor", 1.0)) / 2)
    return np.array([1.0] * rotated + [1e30] * (pairs - rotated), dtype=np.float32)


def _add_rope_scaling(w, config: dict) -> np.ndarray | None:
    """The model's RoPE scaling as llama.cpp reads it: linear as metadata, Llama 3's as the
    ``rope_freqs`` tensor (returned, for a llama file); any other kind is refused by name."""
    import gguf

    sc = config.get("rope_scaling") or {}
    if config["model_type"] == "ministral3":  # its RoPE settings live in rope_parameters
        sc = config.get("rope_parameters") or {}
    kind = sc.get("rope_type") or sc.get("type") or "default"
    if kind == "default":
        return None
    if kind in ("yarn", "deepseek_yarn") and FAMILIES[config["model_type"]].arch == "deepseek2":
        if sc.get("mscale", 1.0) != sc.get("mscale_all_dim", 0.0):
            raise UserInputError(
                "llama.cpp's deepseek2 reads one yarn mscale (mscale_all_dim); this model's "
                "mscale and mscale_all_dim differ",
                "export --format gguf",
            )
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(sc.get("mscale_all_dim", 0.0)))
        return None
    if kind == "yarn" and config["model_type"] == "ministral3":
        # Mistral's yarn: mscale_all_dim as the log multiplier, and Llama 4's position-wise
        # attention temperature (beta, over the original context)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        w.add_rope_scaling_yarn_log_mul(float(sc.get("mscale_all_dim", 0.0)))
        if sc.get("llama_4_scaling_beta") is not None:
            w.add_attn_temperature_scale(float(sc["llama_4_scaling_beta"]))
        return None
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(sc["factor"]))
        return None
    if kind == "yarn" and not {"mscale", "mscale_all_dim"} & set(sc):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        return None
    if kind == "llama3" and FAMILIES[config["model_type"]].arch == "llama":
        return llama3_rope_factors(rope_base(config), _heads(config)[2], sc)
    raise UserInputError(
        f"RoPE scaling {kind!r} of a {config['model_type']} model, as its config sets it, is "
        "not one llama.cpp reads from mlxtune's GGUF (linear, yarn without DeepSeek's mscale "
        "keys, and Llama 3's in llama files are)",
        "export --format gguf",
    )


def _ffn_width(model, config: dict) -> int:
    """The dense MLP's hidden width: LFM2 works its own out of block_ff_dim, so it is read off
    the weights there."""
    if config["model_type"] == "lfm2" and model is not None:
        for name, v in tree_flatten(model.parameters()):
            if name.endswith("feed_forward.w1.weight"):
                return int(v.shape[0])
    return int(config["intermediate_size"])


def _tensor_for_gguf(a: np.ndarray, g: str, family, n_head: int, n_kv: int) -> np.ndarray:
    """A parameter (fp32) as llama.cpp's converter stores it under GGUF name ``g``."""
    if family.permuted and g.endswith(("attn_q.weight", "attn_q.bias")):
        return permute_qk(a, n_head)
    if family.permuted and g.endswith(("attn_k.weight", "attn_k.bias")):
        return permute_qk(a, n_kv)
    if family.norm_plus_one and g.endswith("norm.weight"):
        return a + 1.0
    if g.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):  # MLX's [C, K, 1] -> [C, K]
        return a.reshape(a.shape[0], a.shape[1])
    return a


def _tiled_v_heads(a: np.ndarray, axis: int, args, head_dim: int) -> np.ndarray:
    """V heads along ``axis`` from grouped by key head (HF: k0's v heads, then k1's) to tiled
    (v0 of every key head, then v1 ...), the order llama.cpp's qwen35 broadcasts in."""
    nk = args.linear_num_key_heads
    r = args.linear_num_value_heads // nk
    moved = np.moveaxis(a, axis, 0)
    tiled = moved.reshape(nk, r, head_dim, *moved.shape[1:]).swapaxes(0, 1)
    return np.moveaxis(tiled.reshape(moved.shape), 0, axis)


def _qwen35_tensor(a: np.ndarray, g: str, args, lora: str = "") -> np.ndarray:
    """A Qwen3.5 gated delta-net tensor (or one LoRA factor of it: ``lora`` "a" or "b") as
    llama.cpp's converter writes it: V heads tiled, A as -exp(A_log)."""
    if lora != "a" and g.endswith(".ssm_a"):
        a = -np.exp(a)
    if args.linear_num_key_heads == args.linear_num_value_heads:
        return a
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    qk = 2 * args.linear_num_key_heads * dk
    if lora == "a":  # an adapter's A factor: only ssm_out's input columns are V heads
        return _tiled_v_heads(a, 1, args, dv) if g.endswith("ssm_out.weight") else a
    if g.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
        return np.concatenate([a[:qk], _tiled_v_heads(a[qk:], 0, args, dv)], axis=0)
    if g.endswith("attn_gate.weight"):
        return _tiled_v_heads(a, 0, args, dv)
    if g.endswith(("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", ".ssm_a")):
        return _tiled_v_heads(a, 0, args, 1)
    if g.endswith("ssm_out.weight") and lora != "b":
        return _tiled_v_heads(a, 1, args, dv)
    return a


def _linear_attention_tensors(a: np.ndarray, g: str, args):
    """Qwen3-Next's gated delta-net tensors as llama.cpp's converter writes them, or None for
    any other tensor: the fused q/k/v/z projection (grouped per key head) as one q/k/v
    projection and a z gate, A as -exp(A_log), the conv kernel without its unit axis."""
    if g.endswith("ssm_in.weight"):
        nk, dk = args.linear_num_key_heads, args.linear_key_head_dim
        nv, dv = args.linear_num_value_heads, args.linear_value_head_dim
        per = [dk, dk, nv // nk * dv, nv // nk * dv]
        grouped = a.reshape(nk, sum(per), a.shape[-1])
        q, k, v, z = np.split(grouped, np.cumsum(per)[:-1], axis=1)
        flat = [x.reshape(-1, a.shape[-1]) for x in (q, k, v, z)]
        block = g[: -len("ssm_in.weight")]
        return [
            (f"{block}attn_qkv.weight", np.concatenate(flat[:3], axis=0)),
            (f"{block}attn_gate.weight", flat[3]),
        ]
    if g.endswith(".ssm_a"):
        return [(g, -np.exp(a))]
    return None


def _names(model, config: dict, where: str) -> dict[str, str]:
    """Parameter name -> GGUF name, every parameter named (UserInputError otherwise)."""
    mt, layers = config["model_type"], config["num_hidden_layers"]
    out = {}
    for hf, _ in tree_flatten(model.parameters()):
        g = gguf_name(hf, mt, layers)
        if g is None:
            raise UserInputError(
                f"llama.cpp's {FAMILIES[mt].arch} architecture holds no tensor for {hf!r}", where
            )
        out[hf] = g
    return out


def write_gguf_model(
    model,
    config: dict,
    tokenizer,
    tokenizer_dir: Path | None,
    out: Path,
    dtype: str = "f16",
    name: str = "model",
    tokenizer_gguf: Path | None = None,
):
    """The (already fused) model as one GGUF file; returns its path. ``tokenizer_gguf``: a GGUF
    file whose tokenizer fields are copied as they are (a run over a GGUF base)."""
    import gguf

    if dtype not in DTYPES:
        raise UserInputError(
            f"GGUF dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", "--dtype"
        )
    where = "export --format gguf"
    model, config = text_part(model, config)
    arch, _ = _arch(config)
    family = FAMILIES[config["model_type"]]
    n_head, n_kv, head_dim = _heads(config)
    scalar = getattr(_args(model), "query_pre_attn_scalar", None)
    if config["model_type"] == "gemma2" and scalar is not None and scalar != head_dim:
        raise UserInputError(
            f"llama.cpp scales gemma2 queries by 1/sqrt(head_dim); this model's query_pre_attn_scalar "
            f"is {scalar:g}, not head_dim {head_dim}",
            where,
        )
    why = _refusal(model, config)
    if why is not None:
        raise UserInputError(why, where)
    names = _names(model, config, where)
    path = out / f"{name}-{dtype}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[dtype])
    _add_hparams(w, config, model)
    if config["model_type"] == "gemma4_text":
        rope_freqs = _gemma4_rope_freqs(_args(model))
    else:
        rope_freqs = _add_rope_scaling(w, config)
    if tokenizer_gguf is not None:
        template = getattr(getattr(tokenizer, "_tokenizer", None), "chat_template", None)
        _copy_tokenizer(w, Path(tokenizer_gguf), template if isinstance(template, str) else None)
    else:
        _add_tokenizer(w, tokenizer_dir, tokenizer)
    shapes = {}
    for hf, v in tree_flatten(model.parameters()):
        g = names[hf]
        a = _tensor_for_gguf(np.array(v.astype(mx.float32)), g, family, n_head, n_kv)
        if family.arch in ("qwen35", "qwen35moe"):
            a = _qwen35_tensor(a, g, _args(model))
        if family.arch in ("mamba2", "nemotron_h_moe", "granitehybrid"):
            a = _ssm_tensor(a, g, _args(model))
        split = (
            _linear_attention_tensors(a, g, _args(model)) if family.arch == "qwen3next" else None
        )
        if g.endswith(f"{SHARED_GATE_UP}.weight"):  # gate rows, then up rows
            gate, up = np.split(a, 2, axis=0)
            block = g[: -len(f"{SHARED_GATE_UP}.weight")]
            split = [(f"{block}ffn_gate_shexp.weight", gate), (f"{block}ffn_up_shexp.weight", up)]
        if split is not None:
            for g2, a2 in split:
                data, raw = _tensor_array(np.ascontiguousarray(a2, dtype=np.float32), dtype)
                w.add_tensor(g2, data, raw_dtype=raw)
                shapes[g2] = a2.shape[::-1]
            continue
        a = np.ascontiguousarray(a, dtype=np.float32)
        # routers and short convolutions stay f32, as llama.cpp's converter keeps them
        f32 = ("ffn_gate_inp.weight", "shortconv.conv.weight", "attn_sinks.weight")
        kind = "f32" if g.endswith(f32) else dtype
        data, raw = _tensor_array(a, kind)
        w.add_tensor(g, data, raw_dtype=raw)
        shapes[g] = a.shape[::-1]
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
        shapes["rope_freqs.weight"] = rope_freqs.shape
    _finish(w)
    verify(path, arch, shapes)
    return path


def write_gguf_adapter(model, config: dict, alpha: float, out: Path, name: str = "adapter"):
    """The LoRA adapter of a model (its LoRALinear layers) for llama.cpp's --lora; returns its path."""
    import gguf

    where = "export --format gguf-adapter"
    model, config = text_part(model, config)
    arch, permute = _arch(config)
    why = _refusal(model, config)
    if why is not None:
        raise UserInputError(why, where)
    n_head, n_kv, _ = _heads(config)
    layers = config["num_hidden_layers"]
    path = out / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_name(name)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    shapes = {}
    for mod_name, m in model.named_modules():
        if isinstance(m, LoRASwitchLinear):
            raise UserInputError(
                f"{mod_name} adapts a mixture's experts, which llama.cpp's LoRA adapters do not "
                "hold; export gguf (fused) instead, or leave the experts out of adapter.targets",
                where,
            )
        if not isinstance(m, LoRALinear):
            continue
        if isinstance(m, DoRALinear):
            raise UserInputError(
                "llama.cpp's LoRA adapters cannot hold DoRA; export gguf (fused) instead", "export"
            )
        g = gguf_name(f"{mod_name}.weight", config["model_type"], layers)
        if g is None:
            raise UserInputError(f"no GGUF name for {mod_name!r}", where)
        a = np.ascontiguousarray(np.array(m.lora_a.astype(mx.float32)).T)  # [r, in]
        b = np.ascontiguousarray(np.array(m.lora_b.astype(mx.float32)).T)  # [out, r]
        if permute and g.endswith("attn_q.weight"):
            b = permute_qk(b, n_head)
        elif permute and g.endswith("attn_k.weight"):
            b = permute_qk(b, n_kv)
        pairs = [(g, b)]
        if arch == "qwen3next":  # the fused projection is two tensors there: B's rows split
            pairs = _linear_attention_tensors(b, g, _args(model)) or pairs
        if g.endswith(f"{SHARED_GATE_UP}.weight"):  # B's rows: the gate's, then the up's
            block = g[: -len(f"{SHARED_GATE_UP}.weight")]
            gate, up = np.split(b, 2, axis=0)
            pairs = [(f"{block}ffn_gate_shexp.weight", gate), (f"{block}ffn_up_shexp.weight", up)]
        if arch in ("qwen35", "qwen35moe"):  # V heads tiled in B's rows (ssm_out: A's columns)
            a = np.ascontiguousarray(_qwen35_tensor(a, g, _args(model), "a"))
            pairs = [(g, _qwen35_tensor(b, g, _args(model), "b"))]
        for name_, b_ in pairs:
            b_ = np.ascontiguousarray(b_)
            w.add_tensor(f"{name_}.lora_a", a)
            w.add_tensor(f"{name_}.lora_b", b_)
            shapes[f"{name_}.lora_a"], shapes[f"{name_}.lora_b"] = a.shape[::-1], b_.shape[::-1]
    _finish(w)
    verify(path, arch, shapes, adapter=True)
    return path


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def verify(path: Path, arch: str, shapes: dict, adapter: bool = False):
    """Read a GGUF back and check its header, metadata and tensor shapes (GGUF lists dims
    innermost first)."""
    import gguf

    try:
        r = open_gguf(path)
    except UserInputError as e:
        raise UserInputError(f"the GGUF just written does not read back: {e}", str(path)) from None
    field = r.fields.get
    problems = []
    if field("general.architecture") != arch:
        problems.append(f"general.architecture is {field('general.architecture')!r}, not {arch!r}")
    if adapter and (field("general.type") != "adapter" or field("adapter.type") != "lora"):
        problems.append("adapter metadata (general.type, adapter.type) missing")
    if not adapter:
        array, int32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32
        if r.types.get("tokenizer.ggml.token_type") != (array, int32):
            problems.append("tokenizer.ggml.token_type is not an array of int32")
    got = {name: tuple(int(x) for x in t.shape) for name, t in r.tensors.items()}
    for name, shape in shapes.items():
        if name not in got:
            problems.append(f"tensor {name} is missing")
        elif got[name] != tuple(int(x) for x in shape):
            problems.append(f"tensor {name} has shape {got[name]}, expected {tuple(shape)}")
    if problems:
        path.unlink(missing_ok=True)
        raise UserInputError("GGUF check failed: " + "; ".join(problems), str(path))
