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
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserInputError
from .common import cast_floats
from .loading import check_model_dir
from .vision_families import VisionFamily, vision_family, vision_family_class

IMAGE_KEYS = ("image_index", "positions")
"""The batch arrays a VisionLM's forward reads in the step (besides ``features``), each with
the batch's token axis last: sliced with the tokens. ``positions`` only for a family whose
rotary positions the host makes (``VisionFamily.mrope``)."""
FEATURE_ROWS = 64
"""A step's image features come in rows of a multiple of this (see ``VisionLM.prepare``)."""


def is_vision_config(config: dict) -> bool:
    """Whether a model's config.json is a vision-language model's (it has a vision tower)."""
    return isinstance(config.get("vision_config"), dict)


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
        if k in batch:
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


def _hf(tokenizer):
    """The Hugging Face tokenizer inside mlxtune's (or the one given)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


class _Codec:
    """A tokenizer's plain-text encoding and decoding (no special tokens added, none
    skipped), and the ids of its added tokens: those it splits out of a text before encoding
    the rest, so that the text between two of them encodes on its own."""

    def __init__(self, tokenizer):
        hf = _hf(tokenizer)
        self.hf, self.backend = hf, getattr(hf, "backend_tokenizer", None)
        self.added = set(getattr(hf, "added_tokens_decoder", {}))

    def encode(self, text: str) -> list[int]:
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).ids
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.hf.decode(ids, skip_special_tokens=False)

    def name(self, token_id: int) -> str:
        return self.hf.convert_ids_to_tokens(int(token_id))


class ImageTokens:
    """A family's image processor, and the tokens each image takes: what encoding data needs
    of a vision model before the model loads."""

    def __init__(self, family: VisionFamily, processor):
        self.family, self.processor = family, processor
        self.token_id = family.token_id
        self._expansions: dict = {}

    def processed(self, paths: list[Path], where: str) -> tuple[dict[str, np.ndarray], list]:
        """The images as the tower reads them, and each one's layout (``VisionFamily``)."""
        pictures = [read_image(p, where) for p in paths]
        return self.family.process(self.processor, pictures)

    def process(self, paths: list[Path], where: str) -> dict[str, np.ndarray]:
        """The images as the tower reads them."""
        return self.processed(paths, where)[0]

    def layouts(self, paths: list[Path], where: str) -> list:
        """Each image's layout: what sets its tokens."""
        return self.processed(paths, where)[1] if paths else []

    def counts(self, paths: list[Path], where: str) -> list[int]:
        """How many image tokens each image becomes."""
        return [self.family.tokens(x) for x in self.layouts(paths, where)]

    def _expansion(self, layout, codec: _Codec) -> list[tuple[int | None, str]]:
        """One image's expansion as (added token id, "") and (None, plain text) items."""
        key = (layout, id(codec.hf))
        if key not in self._expansions:
            ids = codec.encode(self.family.expansion(layout, codec.name))
            items: list[tuple[int | None, str]] = []
            run: list[int] = []
            for i in [*ids, None]:
                if (i is None or i in codec.added) and run:
                    items.append((None, codec.decode(run)))
                    run = []
                if i is not None:
                    items.append((i, "")) if i in codec.added else run.append(i)
            self._expansions[key] = items
        return self._expansions[key]

    def expand(self, ids: list[int], mask: list[int], layouts: list, tokenizer, where: str):
        """``ids`` (one marker an image, as the chat template writes it) with each marker
        replaced by its image's expansion, as the family's processor replaces it in the
        rendered text: the plain text the expansion joins on either side is encoded again as
        one (no added token between), so the tokens are those of the processor's text. The
        expansion's tokens are never targets, nor is a rejoined text run that held any token
        that was not one."""
        marker = self.family.marker_id
        found = sum(1 for i in ids if i == marker)
        if found != len(layouts):
            raise UserInputError(
                f"the row has {len(layouts)} image(s) and its chat renders {found} image "
                "token(s): each image needs an image part in a message's content",
                where,
            )
        codec = _Codec(tokenizer)
        out_ids: list[int] = []
        out_mask: list[int] = []
        run: list = []  # the plain text run being read: (ids, masks) or (None, joined text)

        def flush():
            if any(part[0] is None for part in run):  # text joined it: encode it again
                text = "".join(codec.decode(p) if p is not None else t for p, t in run)
                new = codec.encode(text)
                kept = [m for p, ms in run if p is not None for m in ms]
                out_ids.extend(new)
                out_mask.extend([min(kept, default=0)] * len(new))
            else:
                for p, ms in run:
                    out_ids.extend(p)
                    out_mask.extend(ms)
            run.clear()

        k = 0
        for i, m in zip(ids, mask, strict=True):
            if i == marker:
                for token, text in self._expansion(layouts[k], codec):
                    if token is None:
                        run.append((None, text))
                    else:
                        flush()
                        out_ids.append(token)
                        out_mask.append(0)
                k += 1
            elif i in codec.added:
                flush()
                out_ids.append(i)
                out_mask.append(m)
            elif run and run[-1][0] is not None:
                run[-1][0].append(i)
                run[-1][1].append(m)
            else:
                run.append(([i], [m]))
        flush()
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

        try:
            processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (ValueError, OSError, KeyError):
            # a class transformers does not know (mlx-vlm's convert writes its own image
            # processors' names into processor_config.json): mlx-vlm's processor reads it
            from mlx_vlm.utils import load_processor

            processor = getattr(load_processor(model_dir), "image_processor", None)
            if processor is None:
                raise UserInputError(
                    "neither transformers nor mlx-vlm reads this folder's image processor",
                    str(model_dir / "preprocessor_config.json"),
                ) from None
    family.check_processor(processor, str(model_dir / "preprocessor_config.json"))
    return ImageTokens(family, processor)


# -------------------------------------------------------------------------------------- model


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

    def make_cache(self) -> list:
        """The language model's caches for generation: mlx-lm's plain KV caches where its own
        are plain ones (so prompts decode left-padded in compiled steps), else its own (sliding
        windows)."""
        from mlx_lm.models.cache import KVCache
        from mlx_vlm.models.cache import KVCache as VlmKVCache

        lm = self.vlm.language_model
        own = lm.make_cache() if hasattr(lm, "make_cache") else None
        if own is None or all(type(c) is VlmKVCache for c in own):
            return [KVCache() for _ in self.layers]
        return own

    def features(self, arrays: dict[str, mx.array]) -> mx.array:
        """The images' features [image tokens, D] as the language model takes them: the
        tower and projector, outside any compiled step, no gradient through them."""
        return mx.stop_gradient(self.family.features(self.vlm, arrays))

    def _tower_trainable(self) -> dict[str, mx.array]:
        names = tuple(f"vlm.{k}." for k in self.tower_names)
        return {k: v for k, v in tree_flatten(self.trainable_parameters()) if k.startswith(names)}

    @property
    def tower_trains(self) -> bool:
        """Whether adapters in the tower or projector train (``adapter.targets``): the step
        then hands back the gradient of the features, and ``tower_gradients`` carries it
        through the tower."""
        return bool(self._tower_trainable())

    def tower_gradients(self, arrays: dict[str, mx.array], cotangent: mx.array) -> dict:
        """{path: gradient} of the tower's trainable weights given ``cotangent``, the gradient
        of the loss with respect to a step's ``features`` (padded as ``prepare`` pads them),
        from the tower's inputs ``arrays``: the tower runs again here, outside the compiled
        step, and its backward with it (mx.vjp)."""
        own = self._tower_trainable()
        keys = list(own)

        def padded_features(*weights):
            self.update(tree_unflatten(list(zip(keys, weights, strict=True))))
            out = self.family.features(self.vlm, arrays).astype(cotangent.dtype)
            pad = cotangent.shape[0] - out.shape[0]
            return mx.pad(out, [(0, pad), (0, 0)]) if pad else out

        try:
            _, grads = mx.vjp(padded_features, [own[k] for k in keys], [cotangent])
        finally:
            self.update(tree_unflatten(list(own.items())))  # the weights, not the vjp's copies
        return dict(zip(keys, grads, strict=True))

    def tower_pass_bytes(self, train_set, rows: int) -> float:
        """What the tower's pass adds to MLX's memory for a batch of ``rows`` copies of the
        training example with the most image tokens: measured, by running the tower (and,
        where adapters in it train, its backward) on those images once; 0 without images."""
        shown = [e for e in train_set.examples if getattr(e, "images", None)]
        if not shown:
            return 0.0
        token = self.image_tokens.token_id
        most = max(shown, key=lambda e: sum(1 for i in e.ids if i == token))
        files = [Path(p) for p in most.images]
        arrays = self.batch_arrays(np.array([most.ids] * rows), [files] * rows, "memory plan")
        arrays = {k: mx.array(v) for k, v in arrays.items()}
        tower = {k: arrays[k] for k in self.family.tower_keys}
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        features = self.prepare(arrays)["features"]
        mx.eval(features)
        if self.tower_trains:
            mx.eval(self.tower_gradients(tower, mx.ones(features.shape, mx.float32)))
        peak = mx.get_peak_memory() - base
        del features
        mx.clear_cache()
        return float(max(peak, 0))

    def batch_arrays(
        self, tokens: np.ndarray, paths: list[list[Path]], where: str = "batch"
    ) -> dict[str, np.ndarray]:
        """A batch's image arrays on the host: what the tower reads (the family's
        ``tower_keys``) and what the forward reads (``IMAGE_KEYS``), from its [B, L] ids and
        each row's image files."""
        flat = [p for row in paths for p in row]
        it, family = self.image_tokens, self.family
        px, layouts = it.processed(flat, where)
        counts = [family.tokens(x) for x in layouts]
        is_image = tokens == it.token_id
        if int(is_image.sum()) != sum(counts):
            raise UserInputError(
                f"the batch holds {int(is_image.sum())} image tokens for {len(flat)} image(s) "
                f"that take {sum(counts)}",
                where,
            )
        index = np.where(is_image, np.cumsum(is_image.reshape(-1)).reshape(tokens.shape) - 1, -1)
        out = {**px, "image_index": index.astype(np.int32)}
        if family.mrope:
            starts = np.cumsum([0] + [len(row) for row in paths])
            grids = px["image_grid"]
            out["positions"] = np.stack(
                [
                    family.positions(tokens[b], grids[starts[b] : starts[b + 1]])
                    for b in range(len(tokens))
                ],
                axis=1,
            )
        return out

    def prepare(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """A step's arrays with the images (the family's ``tower_keys``) replaced by their
        ``features``."""
        if "pixel_values" not in arrays:
            return arrays
        keys = self.family.tower_keys
        out = {k: v for k, v in arrays.items() if k not in keys}
        features = self.features({k: arrays[k] for k in keys})
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
        position is from its length (Qwen2-VL's image tokens take fewer positions than
        tokens), which the decode steps add to the cache's offset."""
        width = max(len(p) for p in prompts)
        tokens = np.array([[0] * (width - len(p)) + list(p) for p in prompts], np.int64)
        arrays = self.batch_arrays(tokens, files, where)
        shift = [0] * len(prompts)
        if self.family.mrope:
            grids, at = arrays["image_grid"], 0
            for b, p in enumerate(prompts):
                n = len(files[b])
                pos = self.family.positions(np.array(p), grids[at : at + n])
                at += n
                arrays["positions"][:, b, :] = 0
                arrays["positions"][:, b, width - len(p) :] = pos
                shift[b] = int(pos.max()) + 1 - len(p) if len(p) else 0
        prepared = self.prepare({k: mx.array(v) for k, v in arrays.items()})
        return step_images(prepared), shift

    def __call__(self, inputs: mx.array, cache=None):
        lm = self.vlm.language_model
        h = self.family.embed_tokens(lm)(inputs)
        got, positions, visual = _IMAGES.get(), None, None
        if got is not None:
            index = got["image_index"]
            visual = ((index >= 0)[..., None], got["features"][mx.maximum(index, 0)])
            h = mx.where(visual[0], self.family.embedded(visual[1], lm).astype(h.dtype), h)
            positions = got.get("positions")
        if self.family.mrope and positions is None:
            # text: each row's positions from its cache's (a batched cache's: per row)
            b, t = inputs.shape
            offset = 0 if not cache or cache[0] is None else cache[0].offset
            offset = mx.array(offset).reshape(-1, 1) if not isinstance(offset, int) else offset
            positions = mx.broadcast_to(offset + mx.arange(t)[None, :], (3, b, t))
        return self.family.logits(lm, inputs, h, cache, positions, visual)


def write_vision_base(arch: dict, tokenizer, tokenizer_dir: Path, out: Path, seed: int) -> Path:
    """A new vision-language model of architecture ``arch`` (its config.json keys, the tower's
    under ``vision_config``), randomly initialised from ``seed``, written to ``out`` as a model
    folder mlx-vlm loads: config.json (the special tokens' ids from ``tokenizer``),
    model.safetensors, and the tokenizer and image processor of ``tokenizer_dir``. It then trains
    as a downloaded model does (its frozen tower is the one written)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    family = vision_family_class(arch, "model.arch.model_type")
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
    text = config.get("text_config")
    if isinstance(text, dict):  # a family whose language model's keys sit apart
        text.setdefault("vocab_size", config["vocab_size"])
    for where, n in (("model.arch.vocab_size", config["vocab_size"]),
                     ("model.arch.text_config.vocab_size", (text or {}).get("vocab_size"))):  # fmt: skip
        if n is not None and n < len(hf):
            raise UserInputError(f"vocab_size {n} is smaller than the tokenizer's {len(hf)}", where)
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
    for k, w in weights.items():
        # a matrix its class starts constant (Gemma 3's projection: ones, every output the
        # same sum) is drawn at random: a new model's features then vary along every axis
        if w.ndim >= 2 and w.size > 1 and bool(mx.all(w == w.reshape(-1)[0])):
            std = (2.0 / (w.shape[0] + w.shape[-1])) ** 0.5
            weights[k] = (mx.random.normal(w.shape) * std).astype(w.dtype)
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
