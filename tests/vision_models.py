"""Tiny vision-language models of each family mlxtune trains, built from mlx-vlm's own classes
with random weights, with a tokenizer and an image processor config of the family's kind, and
the colour-of-an-image task drawn with Pillow."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COLOUR_TOKENIZER = REPO / "recipes" / "data" / "colours" / "tokenizer"

_PATCHES = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
_TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
_SIGLIP = {  # a SigLIP tower of 56-pixel tiles in 14-pixel patches (16 patches)
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": 56,
}

# each family's architecture, tiny: two blocks of width 64, a two-block tower
VISION_ARCHS = {
    "qwen2_vl": {
        "model_type": "qwen2_vl",
        **_TEXT,
        "tie_word_embeddings": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "spatial_patch_size": 14,
            **_PATCHES,
        },
    },
    "qwen2_5_vl": {  # window attention in tower block 0, full attention in block 1
        "model_type": "qwen2_5_vl",
        **_TEXT,
        "tie_word_embeddings": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            **_PATCHES,
        },
    },
    "qwen3_vl": {  # 16-pixel patches; tower block 0's features added after LM block 0
        "model_type": "qwen3_vl",
        "text_config": {
            "model_type": "qwen3_vl_text",
            **_TEXT,
            "head_dim": 16,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },  # fmt: skip
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
    },
    "gemma3": {  # 4 image tokens an image (16 patches pooled 2 x 2); layer 0 a 16-token window
        "model_type": "gemma3",
        "hidden_size": 64,
        "mm_tokens_per_image": 4,
        "text_config": {
            "model_type": "gemma3_text",
            **_TEXT,
            "rope_theta": 1000000.0,  # the global layers' (the sliding ones: 10,000)
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": 4,
        },
        "vision_config": {"model_type": "siglip_vision_model", "vision_use_head": False, **_SIGLIP},
    },
    "smolvlm": {  # 4 image tokens a tile (16 patches pixel-shuffled 2 x 2)
        "model_type": "smolvlm",
        "scale_factor": 2,
        "text_config": {"model_type": "llama", **_TEXT},
        "vision_config": {"model_type": "smolvlm_vision", **_SIGLIP},
    },
    "llava": {  # a CLIP tower on 56-pixel pictures: 16 patches, 16 image tokens
        "model_type": "llava",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": {"model_type": "llama", **_TEXT},
        "vision_config": {"model_type": "clip_vision_model", "projection_dim": 32, **_SIGLIP},
    },
    "mistral3": {  # a Pixtral tower at the picture's size: a token a 2 x 2 merge of patches
        "model_type": "mistral3",
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "text_config": {"model_type": "mistral", **_TEXT, "head_dim": 16},
        "vision_config": {"model_type": "pixtral", **_SIGLIP, "head_dim": 16, "image_size": 112},
    },
    "idefics3": {  # SmolVLM's forerunner: the same tower, connector and tiles
        "model_type": "idefics3",
        "scale_factor": 2,
        "text_config": {"model_type": "llama", **_TEXT},
        "vision_config": {"model_type": "idefics3_vision", **_SIGLIP},
    },
}

_NORMALISE = {
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}
_CONTENT = (  # a message's content, a string or parts; IMAGE: what the template writes
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}IMAGE"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
)
# the tokenizers other families read (the Qwen families read the quickstart's): special tokens,
# a chat template showing an image as the family's does, and an image processor config
FAMILY_TOKENIZERS = {
    "gemma3": {
        "specials": [
            "<pad>",
            "<eos>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        ],  # fmt: skip
        "eos": "<end_of_turn>",
        "pad": "<pad>",
        "named": {  # what Gemma 3's processor reads off its tokenizer
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "template": (
            "{% for message in messages %}<start_of_turn>"
            "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
            + _CONTENT.replace("IMAGE", "<start_of_image>")
            + "<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
        ),
        "processor": {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "size": {"height": 56, "width": 56},
            "do_pan_and_scan": False,
            "resample": 2,
            **_NORMALISE,
        },
    },
    "smolvlm": {
        "specials": [
            "<|endoftext|>",
            "<|im_start|>",
            "<end_of_utterance>",
            "<image>",
            "<fake_token_around_image>",
            "<global-img>",
        ]
        + [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)],  # fmt: skip
        "eos": "<end_of_utterance>",
        "pad": "<|endoftext|>",
        "template": (
            "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
            + _CONTENT.replace("IMAGE", "<image>")
            + "<end_of_utterance>\n{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}"
        ),
        "processor": {  # pictures cut into 56-pixel tiles after the longest side goes to 112
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "SmolVLMProcessor",
            "do_resize": True,
            "size": {"longest_edge": 112},
            "max_image_size": {"longest_edge": 56},
            "do_image_splitting": True,
            "do_pad": True,
            "resample": 1,
            **_NORMALISE,
        },
    },
}


FAMILY_TOKENIZERS["llava"] = {
    "specials": ["<unk>", "<s>", "</s>", "<image>", "<pad>"],
    "eos": "</s>",
    "pad": "<pad>",
    "template": (
        "{% for message in messages %}{{ message['role'] | upper }}: "
        + _CONTENT.replace("IMAGE", "<image>\n")
        + "{% if message['role'] == 'assistant' %}</s>{% else %} {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
    "processor": {  # shortest side to 56, the centre 56 x 56 cut out
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": 56},
        "do_center_crop": True,
        "crop_size": {"height": 56, "width": 56},
        "resample": 3,
        **_NORMALISE,
    },
}
FAMILY_TOKENIZERS["mistral3"] = {
    "specials": [
        "<unk>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
    ],  # fmt: skip
    "eos": "</s>",
    "pad": "<unk>",
    "template": (
        "<s>{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
        + _CONTENT.replace("IMAGE", "[IMG]")
        + "[/INST]{% else %}"
        + _CONTENT.replace("IMAGE", "[IMG]")
        + "</s>{% endif %}{% endfor %}"
    ),
    "processor": {  # the longest side within 112, sides multiples of 14
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "do_resize": True,
        "size": {"longest_edge": 112},
        "patch_size": {"height": 14, "width": 14},
        "resample": 3,
        **_NORMALISE,
    },
}
FAMILY_TOKENIZERS["idefics3"] = {
    **FAMILY_TOKENIZERS["smolvlm"],
    "processor": {
        **FAMILY_TOKENIZERS["smolvlm"]["processor"],
        "processor_class": "Idefics3Processor",
    },
}


def family_tokenizer(out: Path, family: str, processor: dict | None = None) -> Path:
    """The family's tokenizer folder: the Qwen families read the vision quickstart's; the others
    a byte-level BPE that merges runs of two and three newlines (as real ones do, so that text
    an image's expansion joins encodes differently from its parts), their special tokens and
    chat template, and their image processor config."""
    if family.startswith("qwen"):  # the quickstart's tokenizer
        if family == "qwen2_vl" and not processor:
            return COLOUR_TOKENIZER
        shutil.copytree(COLOUR_TOKENIZER, out, dirs_exist_ok=True)
        given = json.loads((COLOUR_TOKENIZER / "preprocessor_config.json").read_text())
        if family == "qwen3_vl":  # its patches 16 pixels
            given.update(patch_size=16, min_pixels=64 * 64, max_pixels=128 * 128)
        given.update(processor or {})
        (out / "preprocessor_config.json").write_text(json.dumps(given, indent=2))
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILY_TOKENIZERS[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    nl = "Ċ"  # the byte-level alphabet's newline
    vocab[nl * 2], vocab[nl * 3] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(nl, nl), (nl * 2, nl)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(spec["specials"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        extra_special_tokens=spec.get("named", {}),
    )
    fast.chat_template = spec["template"]
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(spec["processor"], indent=2))
    return out


def build_vision_dir(
    out: Path,
    family: str = "qwen2_vl",
    seed: int = 0,
    vision: dict | None = None,
    processor: dict | None = None,
) -> Path:
    """A tiny random-weight vision-language model folder of an mlx-vlm family (built from
    mlx-vlm's own classes by ``write_vision_base``), with the family's tokenizer and image
    processor (``family_tokenizer``); ``vision`` and ``processor`` update the tower's config
    and the Qwen families' image processor's."""
    from mlxtune.models import write_vision_base
    from mlxtune.tokenizer import load_tokenizer

    tok = family_tokenizer(out.parent / "tokenizer", family, processor)
    arch = json.loads(json.dumps(VISION_ARCHS[family]))
    arch["vision_config"].update(vision or {})
    return write_vision_base(arch, load_tokenizer(tok), tok, out, seed)


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def colour_rows(folder: Path, split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` chats asking the colour of an image drawn (in ``folder/img``) in one of COLOURS,
    with noise, at one of three sizes; image paths relative to ``folder``."""
    from PIL import Image

    rng = random.Random(f"{split}{seed}")
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = rng.choice(sorted(COLOURS))
        size = rng.choice([(56, 56), (84, 56), (56, 84)])
        rgb = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[name])
        path = f"img/{split}{i}.png"
        Image.new("RGB", size, rgb).save(folder / path)
        question = [{"type": "image", "image": path}, {"type": "text", "text": "colour?"}]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": name},
                ]
            }
        )
    return rows
