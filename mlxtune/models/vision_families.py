"""The vision-language families mlxtune trains, and what it must know of each.

A family says, for one mlx-vlm model type:

- what its chat template writes for an image (``marker``) and the text its processor puts in
  that place (``expansion``: the image tokens, with whatever frames them);
- how its image processor's arrays go through its vision tower and projector to the features
  that take the image tokens' places (``features``), and how those features enter the language
  model's input embeddings (``embedded``);
- how its language model is called on those embeddings (``logits``), with the rotary positions
  it reads where they are not the tokens' indices (Qwen2-VL's three axes: ``mrope``).

Every other vision-language family is refused by name (``vision_family``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserInputError


def _float_dtype(module: nn.Module):
    """The dtype of a module's first floating-point array (a quantized tower's scales)."""
    for _, v in tree_flatten(module.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


class VisionFamily(ABC):
    """One mlx-vlm family. Made from the model's config.json (``config``)."""

    name = ""
    image_token_key = "image_token_id"
    """The config key of the token id each image's features take the place of."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """(config key, token) of the family's special tokens: a model built from an architecture
    takes their ids from its tokenizer."""
    tower_keys: tuple[str, ...] = ("pixel_values",)
    """The processor's arrays the tower reads (``VisionLM.prepare``)."""
    mrope = False
    """Whether the language model rotates by positions along three axes that the host makes
    (``positions``); otherwise by each token's index, as a text model does."""
    hf_modules: tuple[tuple[str, str], ...] = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    """(mlx-vlm's path prefix, transformers' module path prefix), the first that matches: where
    transformers' model holds each of mlx-vlm's modules (PEFT names adapters so)."""
    projectors: tuple[str, ...] = ("multi_modal_projector",)
    """The paths (in mlx-vlm's model) of what maps the tower's output into the language
    model's width: ``adapter.targets: [projector]`` puts adapters there."""
    hf_legacy: tuple[tuple[str, str], ...] | None = None
    """Another layout transformers reads (an older one it converts on loading), for a family
    whose mlx-vlm loader reads that one but not ``hf_modules``'s."""

    def __init__(self, config: dict):
        self.config = config
        self.token_id = int(config[self.image_token_key])

    def check_processor(self, processor, where: str) -> None:  # noqa: B027 (most have none)
        """Refuse a processor setting the family's path does not follow (none by default)."""

    @abstractmethod
    def process(self, processor, pictures: list) -> tuple[dict[str, np.ndarray], list]:
        """The pictures as the tower reads them, and each picture's layout (what sets its
        tokens: ``tokens`` and ``expansion`` read it)."""

    @abstractmethod
    def tokens(self, layout) -> int:
        """How many image tokens a picture of this layout takes."""

    @property
    def marker_id(self) -> int:
        """The token the chat template writes for one image."""
        return self.token_id

    def expansion(self, layout, names) -> str:
        """The text that takes the marker's place for one picture of this layout (``names``:
        a token id's text)."""
        return names(self.token_id) * self.tokens(layout)

    @abstractmethod
    def features(self, vlm: nn.Module, arrays: dict[str, mx.array]) -> mx.array:
        """The pictures' features [image tokens, hidden], in the order of their tokens."""

    def embedded(self, rows: mx.array, lm: nn.Module) -> mx.array:
        """The input embeddings the image tokens take, from their feature rows (before what
        the language model does to every input embedding)."""
        return rows

    def embed_tokens(self, lm: nn.Module) -> nn.Module:
        return lm.model.embed_tokens

    def logits(self, lm: nn.Module, inputs, h, cache, positions, visual) -> mx.array:
        """The language model's logits for input embeddings ``h``. ``visual``: (which
        positions are image tokens [B, T, 1], their feature rows [B, T, F]), or None."""
        out = lm(inputs, inputs_embeds=h, cache=cache)
        return getattr(out, "logits", out)


# ------------------------------------------------------------------------ Qwen2-VL, Qwen2.5-VL


def mrope_positions(ids: np.ndarray, grids: np.ndarray, token_id: int, merge: int) -> np.ndarray:
    """Qwen2-VL's rotary positions [3, T] of one row: a text token's are its index in all three
    axes (counting an image as far as its largest position), an image's tokens run over
    (time, height, width) of its merged grid from where the next text token would be."""
    pos = np.zeros((3, len(ids)), np.int32)
    nxt = g = i = 0
    while i < len(ids):
        if ids[i] != token_id:
            pos[:, i] = nxt
            nxt += 1
            i += 1
            continue
        t, h, w = (int(v) for v in grids[g])
        g += 1
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        block = np.stack(
            [
                np.repeat(np.arange(t), gh * gw),
                np.tile(np.repeat(np.arange(gh), gw), t),
                np.tile(np.arange(gw), t * gh),
            ]
        )
        pos[:, i : i + n] = block[:, : len(ids) - i] + nxt
        nxt = int(pos[:, i : i + n].max()) + 1
        i += n
    return pos


class Qwen2VL(VisionFamily):
    """Dynamic resolution: a grid of 14-pixel patches, 2 x 2 merged into a token, one
    <|image_pad|> token a merged patch, and rotary positions along (time, height, width) for
    the image tokens."""

    name = "qwen2_vl"
    special_tokens = (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
    )
    tower_keys = ("pixel_values", "image_grid")
    mrope = True
    projectors = ("vision_tower.merger",)
    hf_modules = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.visual."),
    )
    hf_legacy = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "visual."),
    )

    def __init__(self, config: dict):
        super().__init__(config)
        self.merge = int(config["vision_config"].get("spatial_merge_size", 1))

    def process(self, processor, pictures):
        out = processor(images=pictures, return_tensors="np")
        grid = np.asarray(out["image_grid_thw"], np.int64)
        arrays = {"pixel_values": np.asarray(out["pixel_values"], np.float32), "image_grid": grid}
        return arrays, [int(n) for n in (grid.prod(axis=1) // (self.merge * self.merge))]

    def tokens(self, layout) -> int:
        return layout

    def features(self, vlm, arrays):
        tower = vlm.vision_tower
        px = arrays["pixel_values"].astype(_float_dtype(tower))
        return tower(px, arrays["image_grid"], output_hidden_states=False)

    def positions(self, ids: np.ndarray, grids: np.ndarray) -> np.ndarray:
        """Row ``ids``'s rotary positions [3, T], its images' grids ``grids``."""
        return mrope_positions(ids, grids, self.token_id, self.merge)

    def logits(self, lm, inputs, h, cache, positions, visual):
        # the backbone and head, without the language model's own position bookkeeping
        # (which reads the cache's offsets back to the host: no compiled decode step could)
        out = lm.model(inputs, inputs_embeds=h, cache=cache, position_ids=positions)
        return self._head(lm, out)

    @staticmethod
    def _head(lm, out):
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(out)
        return lm.lm_head(out)


class Qwen25VL(Qwen2VL):
    name = "qwen2_5_vl"


class Qwen3VL(Qwen2VL):
    """Qwen2-VL's tokens and positions (16-pixel patches), and "deepstack" features: the tower
    also gives features of some of its blocks, which are added to the image tokens' hidden
    states after the first language-model blocks, one block each. The step's feature rows hold
    the main features and the deepstack ones side by side."""

    name = "qwen3_vl"
    projectors = ("vision_tower.merger", "vision_tower.deepstack_merger_list")

    def __init__(self, config: dict):
        super().__init__(config)
        self.deep = len(config["vision_config"].get("deepstack_visual_indexes") or [])

    def features(self, vlm, arrays):
        tower = vlm.vision_tower
        px = arrays["pixel_values"].astype(_float_dtype(tower))
        main, deep = tower(px, arrays["image_grid"])
        return mx.concatenate([main, *deep], axis=-1)

    def embedded(self, rows, lm):
        return rows[..., : rows.shape[-1] // (1 + self.deep)]

    def logits(self, lm, inputs, h, cache, positions, visual):
        from mlx_vlm.models.base import create_attention_mask

        model = lm.model
        cache = cache or [None] * len(model.layers)
        mask = create_attention_mask(h, cache[0])
        rotary = model.layers[0].self_attn.rotary_emb
        turned = None if rotary.fused_apply else rotary(h, positions)
        width = h.shape[-1]
        for i, (layer, c) in enumerate(zip(model.layers, cache, strict=True)):
            h = layer(h, mask, c, positions, turned)
            if visual is not None and i < self.deep:  # this block's deepstack features
                at, rows = visual
                part = rows[..., (i + 1) * width : (i + 2) * width].astype(h.dtype)
                h = h + mx.where(at, part, mx.zeros_like(part))
        if model.norm is not None:
            h = model.norm(h)
        return self._head(lm, h)


# ------------------------------------------------------------------------------------ Gemma 3


class Gemma3(VisionFamily):
    """A fixed-size image (its processor resizes every picture to the tower's square) becomes
    ``mm_tokens_per_image`` <image_soft_token>s, framed as its processor writes them:
    "\\n\\n<start_of_image>" + tokens + "<end_of_image>\\n\\n" where the template wrote
    <start_of_image>. The language model scales every input embedding by sqrt(hidden), and
    the image features enter unscaled (as transformers' Gemma 3 places them)."""

    name = "gemma3"
    image_token_key = "image_token_index"
    special_tokens = (
        ("image_token_index", "<image_soft_token>"),
        ("boi_token_index", "<start_of_image>"),
        ("eoi_token_index", "<end_of_image>"),
    )

    def __init__(self, config: dict):
        super().__init__(config)
        text = config.get("text_config") or {}
        self.per_image = int(
            text.get("mm_tokens_per_image", config.get("mm_tokens_per_image", 256))
        )
        self.boi, self.eoi = int(config["boi_token_index"]), int(config["eoi_token_index"])

    def check_processor(self, processor, where):
        if getattr(processor, "do_pan_and_scan", False):
            raise UserInputError(
                "do_pan_and_scan (crops of a picture as more images) is not read by mlxtune's "
                "Gemma 3 path: set it false in preprocessor_config.json",
                where,
            )

    def process(self, processor, pictures):
        out = processor(images=pictures, return_tensors="np")
        return {"pixel_values": np.asarray(out["pixel_values"], np.float32)}, [
            self.per_image
        ] * len(pictures)

    def tokens(self, layout) -> int:
        return layout

    @property
    def marker_id(self) -> int:
        return self.boi

    def expansion(self, layout, names) -> str:
        soft = names(self.token_id) * layout
        return f"\n\n{names(self.boi)}{soft}{names(self.eoi)}\n\n"

    def features(self, vlm, arrays):
        px = arrays["pixel_values"].transpose(0, 2, 3, 1).astype(_float_dtype(vlm.vision_tower))
        hidden = vlm.vision_tower(px, output_hidden_states=True)[0]
        out = vlm.multi_modal_projector(hidden)
        return out.reshape(-1, out.shape[-1])

    def embedded(self, rows, lm):
        # the language model multiplies every input embedding by its bfloat16 sqrt(hidden):
        # divided by the same number here, the image rows reach the first block as they are
        scale = mx.array(lm.config.hidden_size**0.5, mx.bfloat16)
        return rows / scale.astype(rows.dtype)


# ------------------------------------------------------------------------ Idefics3, SmolVLM


class Idefics3(VisionFamily):
    """A picture is cut into tiles of the tower's size (rows x cols, by its processor) plus the
    whole picture shrunk to one tile; each tile's patches are pixel-shuffled into
    ``image_seq_len`` <image> tokens, framed by <fake_token_around_image>, a <row_r_col_c> tag
    a tile and <global-img> for the whole, as its processor writes them."""

    name = "idefics3"
    special_tokens = (("image_token_id", "<image>"),)
    tower_keys = ("pixel_values", "pixel_attention_mask")
    projectors = ("connector",)
    hf_modules = (
        ("language_model.lm_head.", "lm_head."),
        ("language_model.", "model.text_model."),
        ("vision_model.", "model.vision_model."),
        ("connector.", "model.connector."),
    )

    def __init__(self, config: dict):
        super().__init__(config)
        vision = config["vision_config"]
        side = int(vision.get("image_size", 384)) // int(vision.get("patch_size", 14))
        self.per_tile = side * side // int(config.get("scale_factor", 2)) ** 2

    def process(self, processor, pictures):
        out = processor(
            images=[[p] for p in pictures], return_tensors="np", return_row_col_info=True
        )
        layouts = [(int(r[0]), int(c[0])) for r, c in zip(out["rows"], out["cols"], strict=True)]
        tiles = np.array([r * c + 1 if r or c else 1 for r, c in layouts], np.int32)
        px = np.asarray(out["pixel_values"], np.float32)
        mask = np.asarray(out["pixel_attention_mask"], bool)
        # each picture's tiles, in the order of their tokens (the padding tiles left out)
        keep = np.concatenate([i * px.shape[1] + np.arange(n) for i, n in enumerate(tiles)])
        return {
            "pixel_values": px.reshape(-1, *px.shape[2:])[keep],
            "pixel_attention_mask": mask.reshape(-1, *mask.shape[2:])[keep],
        }, layouts

    def tokens(self, layout) -> int:
        rows, cols = layout
        return (rows * cols + 1 if rows or cols else 1) * self.per_tile

    def expansion(self, layout, names) -> str:
        image, fake = names(self.token_id) * self.per_tile, "<fake_token_around_image>"
        rows, cols = layout
        whole = f"{fake}<global-img>{image}{fake}"
        if not rows and not cols:
            return whole
        text = ""
        for r in range(rows):
            text += "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
            text += "\n"
        return f"{text}\n{whole}"

    def features(self, vlm, arrays):
        px = arrays["pixel_values"]
        patch = vlm.config.vision_config.patch_size
        mask = arrays["pixel_attention_mask"]
        n, h, w = mask.shape
        ph, pw = h // patch, w // patch
        cells = mask[:, : ph * patch, : pw * patch].reshape(n, ph, patch, pw, patch)
        patches = cells.transpose(0, 1, 3, 2, 4).sum(axis=(-1, -2)) > 0
        tower = vlm.vision_model
        x = px.transpose(0, 2, 3, 1).astype(_float_dtype(tower))
        hidden = tower(x, patch_attention_mask=patches, output_hidden_states=True)[0]
        out = vlm.connector(hidden.astype(x.dtype))
        return out.reshape(-1, out.shape[-1])

    def embed_tokens(self, lm):
        return lm.embed_tokens


class SmolVLM(Idefics3):
    name = "smolvlm"


# -------------------------------------------------------------------------------------- LLaVA


class Llava(VisionFamily):
    """A CLIP (or SigLIP) tower on a fixed square picture: one <image> token a patch (the
    class token dropped by the "default" feature strategy), the features a hidden layer's
    (``vision_feature_layer``, or several concatenated) through a two-layer projector."""

    name = "llava"
    image_token_key = "image_token_index"
    special_tokens = (("image_token_index", "<image>"),)

    def __init__(self, config: dict):
        super().__init__(config)
        vision = config["vision_config"]
        side = int(vision.get("image_size", 336)) // int(vision.get("patch_size", 14))
        self.strategy = config.get("vision_feature_select_strategy", "default")
        self.layer = config.get("vision_feature_layer", -2)
        self.per_image = side * side + (0 if self.strategy == "default" else 1)

    def process(self, processor, pictures):
        out = processor(images=pictures, return_tensors="np")
        arrays = {"pixel_values": np.asarray(out["pixel_values"], np.float32)}
        return arrays, [self.per_image] * len(pictures)

    def tokens(self, layout) -> int:
        return layout

    def features(self, vlm, arrays):
        tower = vlm.vision_tower
        px = arrays["pixel_values"].transpose(0, 2, 3, 1).astype(_float_dtype(tower))
        hidden = tower(px, output_hidden_states=True)[-1]
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        picked = [hidden[i][:, 1:] if self.strategy == "default" else hidden[i] for i in layers]
        out = vlm.multi_modal_projector(mx.concatenate(picked, axis=-1))
        return out.reshape(-1, out.shape[-1])


# ---------------------------------------------------------------------------- Mistral 3


class Mistral3(VisionFamily):
    """A Pixtral tower at the picture's own size (its processor resizes within
    ``longest_edge``, sides multiples of the patch): one [IMG] token a 2 x 2 merged patch, a
    row of them ended by [IMG_BREAK], the last by [IMG_END], as its processor writes them."""

    name = "mistral3"
    image_token_key = "image_token_index"
    special_tokens = (("image_token_index", "[IMG]"),)
    tower_keys = ("pixel_values", "image_sizes")

    def __init__(self, config: dict):
        if "image_token_index" not in config and "image_token_id" in config:
            config = {**config, "image_token_index": config["image_token_id"]}
        super().__init__(config)
        self.patch = int(config["vision_config"].get("patch_size", 14))
        self.merge = int(config.get("spatial_merge_size", 2))
        self.layer = config.get("vision_feature_layer", -1)

    def process(self, processor, pictures):
        out = processor(images=pictures, return_tensors="np")
        sizes = np.asarray(out["image_sizes"], np.int64).reshape(-1, 2)
        side = self.patch * self.merge
        layouts = [(int(h) // side, int(w) // side) for h, w in sizes]
        px = np.asarray(out["pixel_values"], np.float32)
        return {"pixel_values": px, "image_sizes": sizes}, layouts

    def tokens(self, layout) -> int:
        return layout[0] * layout[1]

    def expansion(self, layout, names) -> str:
        rows, cols = layout
        row = names(self.token_id) * cols
        return "[IMG_BREAK]".join([row] * rows) + "[IMG_END]"

    def features(self, vlm, arrays):
        tower = vlm.vision_tower
        px = arrays["pixel_values"].transpose(0, 2, 3, 1).astype(_float_dtype(tower))
        sizes = [tuple(int(v) for v in hw) for hw in np.array(arrays["image_sizes"])]
        hidden = tower(px, output_hidden_states=True, image_sizes=sizes)[-1][self.layer]
        return vlm.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1]), sizes)


VISION_FAMILIES: dict[str, type[VisionFamily]] = {
    f.name: f for f in (Qwen2VL, Qwen25VL, Qwen3VL, Gemma3, Idefics3, SmolVLM, Llava, Mistral3)
}


def vision_family_class(config: dict, where: str) -> type[VisionFamily]:
    """The config's family, or a UserInputError naming a family mlxtune does not train."""
    name = config.get("model_type")
    if name not in VISION_FAMILIES:
        raise UserInputError(
            f"model_type {name!r} is a vision-language model that mlxtune does not train yet "
            f"(it trains {', '.join(sorted(VISION_FAMILIES))})",
            where,
        )
    return VISION_FAMILIES[name]


def vision_family(config: dict, where: str) -> VisionFamily:
    """The config's family, made from it (a UserInputError for one mlxtune does not train)."""
    name = vision_family_class(config, where).name
    try:
        return VISION_FAMILIES[name](config)
    except KeyError as e:
        raise UserInputError(f"a {name} config needs the key {e}", where) from None
    except (TypeError, ValueError) as e:
        raise UserInputError(f"a {name} config has a bad value: {e}", where) from None
