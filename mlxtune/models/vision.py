"""Vision-language models: a family mlx-vlm loads, trained through its language model.

mlx-vlm is to vision-language models what mlx-lm is to text ones: it builds the model (vision
tower, projector, language model) and its image processor. mlxtune wraps the model as a
``VisionLM``, which the rest of mlxtune trains like any mlx-lm model:

- **The tower runs outside the compiled step.** The vision tower and its projector are frozen;
  a batch's images go through them once (``VisionLM.features``) before the step, and their
  features enter the step as an input array. The towers' Python (per-image loops over the
  grids, host reads of their sizes) then never meets ``mx.compile``, and no gradient is taken
  through them.
- **Inside the step the model reads token ids**, as mlx-lm's models do. The forward context
  (``images``) carries the features, which image-token position takes which feature row, and
  the positions the family's rotary embedding reads (Qwen2-VL's three-axis positions), all
  made on the host from the batch's ids and image grids (``VisionLM.batch_arrays``). So the
  LM head, the fused loss, LoRA on the language model and gradient checkpointing work as for
  text.
- **Families** are those whose image tokens, positions and tower call mlxtune knows
  (``VISION_FAMILIES``); any other vision-language family is refused by name.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserInputError
from .common import cast_floats
from .loading import check_model_dir

IMAGE_KEYS = ("image_index", "positions")
"""The batch arrays a VisionLM's forward reads in the step (besides ``features``), each with
the batch's token axis last: sliced with the tokens."""
TOWER_KEYS = ("pixel_values", "image_grid")
"""The batch arrays the tower reads before the step (``VisionLM.prepare``)."""
FEATURE_ROWS = 64
"""A step's image features come in rows of a multiple of this (see ``VisionLM.prepare``)."""


@dataclass(frozen=True)
class VisionFamily:
    """What mlxtune needs to know of one mlx-vlm family."""

    name: str
    image_token_key: str
    """The config key of the token id each image's features take the place of."""
    merge_key: str = "spatial_merge_size"
    """The vision config's key of how many patches a side merge into one token."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """(config key, token) of the family's special tokens: a model built from an architecture
    takes their ids from its tokenizer."""

    def tokens_per_image(self, grid: np.ndarray, merge: int) -> np.ndarray:
        """How many image tokens each image [t, h, w] patch grid becomes."""
        return (grid[:, 0] * grid[:, 1] * grid[:, 2]) // (merge * merge)


# Qwen2-VL and Qwen2.5-VL: dynamic resolution (a grid of 14-pixel patches, 2 x 2 merged into a
# token), one <|image_pad|> token a merged patch, and rotary positions along three axes
# (time, height, width) for the image tokens.
_QWEN_TOKENS = (
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("vision_start_token_id", "<|vision_start|>"),
)
VISION_FAMILIES = {
    name: VisionFamily(name, "image_token_id", special_tokens=_QWEN_TOKENS)
    for name in ("qwen2_vl", "qwen2_5_vl")
}


def is_vision_config(config: dict) -> bool:
    """Whether a model's config.json is a vision-language model's (it has a vision tower)."""
    return isinstance(config.get("vision_config"), dict)


def vision_family(config: dict, where: str) -> VisionFamily:
    """The config's family, or a UserInputError naming a family mlxtune does not train."""
    name = config.get("model_type")
    if name not in VISION_FAMILIES:
        raise UserInputError(
            f"model_type {name!r} is a vision-language model that mlxtune does not train yet "
            f"(it trains {', '.join(sorted(VISION_FAMILIES))})",
            where,
        )
    return VISION_FAMILIES[name]


# ---------------------------------------------------------------------- the forward's context

_IMAGES: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "mlxtune_images", default=None
)


@contextmanager
def images(arrays: dict | None) -> Iterator[None]:
    """While active, a VisionLM's forward places ``arrays["features"]`` at the image tokens
    (``image_index``: each position's feature row, -1 for text) and rotates by
    ``positions``; None (text alone) leaves the forward as for text. Read at trace time, as
    the other forward context is (``models.context``)."""
    token = _IMAGES.set(arrays)
    try:
        yield
    finally:
        _IMAGES.reset(token)


def step_images(batch: dict, end: int | None = None) -> dict | None:
    """What ``images`` takes from a step's batch (None when it has no images), the token axis
    cut at ``end`` (the forward reads every token but the last)."""
    if "features" not in batch:
        return None
    out = {"features": batch["features"]}
    for k in IMAGE_KEYS:
        out[k] = batch[k][..., :end]
    return out


# ------------------------------------------------------------------------------------- images


def read_image(path: Path, where: str):
    """The image at ``path`` as an RGB PIL image; a missing or unreadable one is a bad row
    naming the path."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise UserInputError(f"image not found: {path}", where) from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise UserInputError(f"cannot read the image {path}: {e}", where) from None


class ImageTokens:
    """A family's image processor, and how many tokens each image takes: what encoding data
    needs of a vision model before the model loads."""

    def __init__(self, family: VisionFamily, processor, config: dict):
        self.family, self.processor = family, processor
        self.token_id = int(config[family.image_token_key])
        self.merge = int(config["vision_config"].get(family.merge_key, 1))

    def process(self, paths: list[Path], where: str) -> dict[str, np.ndarray]:
        """The images as the tower reads them: ``pixel_values`` and ``image_grid``."""
        pictures = [read_image(p, where) for p in paths]
        out = self.processor(images=pictures, return_tensors="np")
        return {
            "pixel_values": np.asarray(out["pixel_values"], np.float32),
            "image_grid": np.asarray(out["image_grid_thw"], np.int64),
        }

    def counts(self, paths: list[Path], where: str) -> list[int]:
        """How many image tokens each image becomes."""
        if not paths:
            return []
        grid = self.process(paths, where)["image_grid"]
        return [int(n) for n in self.family.tokens_per_image(grid, self.merge)]

    def expand(self, ids: list[int], mask: list[int], counts: list[int], where: str):
        """``ids`` (one image token an image, as the chat template writes it) with each image
        token repeated as many times as its image takes; the repeats are never targets."""
        found = sum(1 for i in ids if i == self.token_id)
        if found != len(counts):
            raise UserInputError(
                f"the row has {len(counts)} image(s) and its chat renders {found} image "
                "token(s): each image needs an image part in a message's content",
                where,
            )
        out_ids, out_mask, k = [], [], 0
        for i, m in zip(ids, mask, strict=True):
            if i == self.token_id:
                out_ids += [i] * counts[k]
                out_mask += [0] * counts[k]
                k += 1
            else:
                out_ids.append(i)
                out_mask.append(m)
        return out_ids, out_mask


def load_image_tokens(model_dir: Path, config: dict) -> ImageTokens:
    """The model folder's image processor (its preprocessor_config.json, read by mlx-vlm)."""
    # mlx_vlm pulls in transformers: imported when a vision model is used, not with mlxtune
    from mlx_vlm.utils import get_model_and_args, load_image_processor

    family = vision_family(config, str(model_dir / "config.json"))
    get_model_and_args(dict(config))  # registers the family's processor classes
    if not (model_dir / "preprocessor_config.json").exists():
        raise UserInputError(
            "a vision model needs its preprocessor_config.json (how images are resized)",
            str(model_dir),
        )
    processor = load_image_processor(model_dir)
    if processor is None:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(model_dir))
    return ImageTokens(family, processor, config)


# -------------------------------------------------------------------------------------- model


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


class VisionLM(nn.Module):
    """An mlx-vlm model as mlxtune trains it: called with token ids (and, inside ``images``,
    a batch's image features and positions), it gives the language model's logits."""

    def __init__(self, vlm: nn.Module, family: VisionFamily, tokens: ImageTokens):
        super().__init__()
        self.vlm = vlm
        self.family, self.image_tokens = family, tokens
        text = vlm.config.text_config
        self.args = SimpleNamespace(**{**vars(text), "model_type": family.name})

    @property
    def layers(self):
        """The language model's decoder blocks (where adapters go, and what checkpointing
        wraps)."""
        return self.vlm.language_model.layers

    @property
    def tower_names(self) -> list[str]:
        """The top-level modules of the model that are not its language model (the vision
        tower and projector): frozen."""
        return [k for k in self.vlm.children() if k != "language_model"]

    def freeze_tower(self) -> None:
        for k in self.tower_names:
            self.vlm[k].freeze()

    def features(self, pixel_values: mx.array, grid: np.ndarray) -> mx.array:
        """The images' features [N, D] as the language model takes them: the frozen tower and
        projector, outside any compiled step, no gradient through them."""
        tower = self.vlm.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        out = tower(pixel_values.astype(dtype), mx.array(grid), output_hidden_states=False)
        return mx.stop_gradient(out)

    def batch_arrays(
        self, tokens: np.ndarray, paths: list[list[Path]], where: str = "batch"
    ) -> dict[str, np.ndarray]:
        """A batch's image arrays on the host: what the tower reads (``TOWER_KEYS``) and what
        the forward reads (``IMAGE_KEYS``), from its [B, L] ids and each row's image files."""
        flat = [p for row in paths for p in row]
        it = self.image_tokens
        px = it.process(flat, where)
        grid, per_row = px["image_grid"], [len(row) for row in paths]
        counts = self.family.tokens_per_image(grid, it.merge)
        is_image = tokens == it.token_id
        if int(is_image.sum()) != int(counts.sum()):
            raise UserInputError(
                f"the batch holds {int(is_image.sum())} image tokens for {len(flat)} image(s) "
                f"that take {int(counts.sum())}",
                where,
            )
        index = np.where(is_image, np.cumsum(is_image.reshape(-1)).reshape(tokens.shape) - 1, -1)
        starts = np.cumsum([0] + per_row)
        positions = np.stack(
            [
                mrope_positions(tokens[b], grid[starts[b] : starts[b + 1]], it.token_id, it.merge)
                for b in range(len(tokens))
            ],
            axis=1,
        )
        return {**px, "image_index": index.astype(np.int32), "positions": positions}

    def prepare(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """A step's arrays with the images (``TOWER_KEYS``) replaced by their ``features``."""
        if "pixel_values" not in arrays:
            return arrays
        out = {k: v for k, v in arrays.items() if k not in TOWER_KEYS}
        features = self.features(arrays["pixel_values"], np.array(arrays["image_grid"]))
        # rows up to a multiple of FEATURE_ROWS (zeros no token reads): batches whose images
        # take different numbers of tokens reach the compiled step in one shape, one compile
        n = features.shape[0]
        pad = -(-n // FEATURE_ROWS) * FEATURE_ROWS - n
        if pad:
            features = mx.concatenate(
                [features, mx.zeros((pad, features.shape[1]), features.dtype)]
            )
        out["features"] = features
        return out

    def prompt_arrays(
        self, prompts: list[list[int]], files: list[list[Path]], where: str = "prompts"
    ) -> tuple[dict[str, mx.array], list[int]]:
        """What ``images`` takes for prompts read left-padded in one batch (each row's
        positions those of its prompt alone), and each row's rotary shift: how far its next
        position is from its length (image tokens take fewer positions than tokens), which the
        decode steps add to the cache's offset."""
        width = max(len(p) for p in prompts)
        tokens = np.array([[0] * (width - len(p)) + list(p) for p in prompts], np.int64)
        arrays = self.batch_arrays(tokens, files, where)
        it, shift = self.image_tokens, []
        grids = arrays["image_grid"]
        at = 0
        for b, p in enumerate(prompts):
            n = len(files[b])
            pos = mrope_positions(np.array(p), grids[at : at + n], it.token_id, it.merge)
            at += n
            arrays["positions"][:, b, :] = 0
            arrays["positions"][:, b, width - len(p) :] = pos
            shift.append(int(pos.max()) + 1 - len(p) if len(p) else 0)
        prepared = self.prepare({k: mx.array(v) for k, v in arrays.items()})
        return step_images(prepared), shift

    def __call__(self, inputs: mx.array, cache=None):
        lm = self.vlm.language_model
        h = lm.model.embed_tokens(inputs)
        got = _IMAGES.get()
        b, t = inputs.shape
        if got is not None:
            index = got["image_index"]
            rows = got["features"][mx.maximum(index, 0)].astype(h.dtype)
            h = mx.where((index >= 0)[..., None], rows, h)
            positions = got["positions"]
        else:  # text: each row's positions from its cache's (a batched cache's: per row)
            offset = 0 if not cache or cache[0] is None else cache[0].offset
            offset = mx.array(offset).reshape(-1, 1) if not isinstance(offset, int) else offset
            positions = mx.broadcast_to(offset + mx.arange(t)[None, :], (3, b, t))
        # the language model's backbone and head, without its own call's position bookkeeping
        # (which reads the cache's offsets back to the host: no compiled decode step could)
        out = lm.model(inputs, inputs_embeds=h, cache=cache, position_ids=positions)
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(out)
        return lm.lm_head(out)


def write_vision_base(arch: dict, tokenizer, tokenizer_dir: Path, out: Path, seed: int) -> Path:
    """A new vision-language model of architecture ``arch`` (its config.json keys, the tower's
    under ``vision_config``), randomly initialised from ``seed``, written to ``out`` as a model
    folder mlx-vlm loads: config.json (the special tokens' ids from ``tokenizer``),
    model.safetensors, and the tokenizer and image processor of ``tokenizer_dir``. It then trains
    as a downloaded model does (its frozen tower is the one written)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    family = vision_family(arch, "model.arch.model_type")
    if not (tokenizer_dir / "preprocessor_config.json").exists():
        raise UserInputError(
            "a vision model built from model.arch reads images as the tokenizer's folder says: "
            "put its preprocessor_config.json there",
            str(tokenizer_dir),
        )
    config = json.loads(json.dumps(arch))
    hf = tokenizer._tokenizer
    for key, token in family.special_tokens:
        found = hf.convert_tokens_to_ids(token)
        if found is None or found == hf.unk_token_id:
            raise UserInputError(
                f"the tokenizer has no {token} token, which a {family.name} model's {key} is",
                "tokenizer.path",
            )
        config.setdefault(key, int(found))
    config.setdefault("vocab_size", len(hf))
    config.setdefault("eos_token_id", tokenizer.eos_token_id)
    if config["vocab_size"] < len(hf):
        raise UserInputError(
            f"vocab_size {config['vocab_size']} is smaller than the tokenizer's {len(hf)}",
            "model.arch.vocab_size",
        )
    try:
        module, _ = get_model_and_args(dict(config))
        given = json.loads(json.dumps(config))
        model_config = module.ModelConfig.from_dict(given)
        model_config = update_module_configs(
            model_config, module, given, ["text", "vision", "perceiver", "projector", "audio"]
        )
        mx.random.seed(seed)
        vlm = module.Model(model_config)
    except Exception as e:  # the architecture is user input: any failure to build it is bad input
        raise UserInputError(
            f"cannot build this architecture: {type(e).__name__}: {e}", "model.arch"
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(vlm.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    hf.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_bytes(
        (tokenizer_dir / "preprocessor_config.json").read_bytes()
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_vision_model(
    path: Path, config: dict, dtype: str, trust_remote_code: bool = False
) -> VisionLM:
    """The model folder through mlx-vlm's loader, as a VisionLM in ``dtype`` with its tower
    frozen; a folder that asks to run its own code is refused unless ``trust_remote_code``."""
    from mlx_vlm.utils import load_model as vlm_load_model

    check_model_dir(Path(path), trust_remote_code)
    tokens = load_image_tokens(path, config)
    try:
        vlm = vlm_load_model(Path(path))
    except ValueError as e:  # missing or misshapen weights
        raise UserInputError(" ".join(str(e).split()), str(path)) from None
    cast_floats(vlm, dtype)
    return VisionLM(vlm, tokens.family, tokens)
