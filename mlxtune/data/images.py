"""A chat's images in its example: their files (relative to the data file), and each image's
one token in the chat template's rendering repeated as many times as the vision model's image
processor says the image takes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import UserInputError


def content_text(content) -> str:
    """A message's content as text: a string as it is, a list of parts as its text with each
    image shown as ``[image]``."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p["type"] == "text" else "[image]" for p in content)


def image_path(path: str, where: str) -> Path:
    """An image's file: a relative path is relative to the data file the row is in (``where``
    is ``FILE:LINE``)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    source = Path(where.rsplit(":", 1)[0])
    return (source.parent if source.is_file() else Path.cwd()) / p


def with_images(example, piece, tokens, tokenizer, where: str):
    """``example`` (``piece`` encoded with one marker an image, as the chat template writes
    it) showing ``piece.images``: its ids, mask and prompt ids with each marker expanded to its
    image's tokens as the family's processor writes them (never targets), and its files; as it
    is when the piece shows none. ``tokens``: the vision model's ``models.vision.ImageTokens``;
    None (a text model) refuses a row with images."""
    images = getattr(piece, "images", None)
    if not images:
        return example
    if tokens is None:
        raise UserInputError(
            "the row shows images, and the model is no vision-language model", where
        )
    paths = tuple(str(image_path(p, where)) for p in images)
    layouts = tokens.layouts([Path(p) for p in paths], where)
    ids, mask = tokens.expand(example.ids, example.mask, layouts, tokenizer, where)
    prompt_ids = example.prompt_ids
    if prompt_ids:  # the prompt shows the images before the last answer
        k = sum(1 for i in prompt_ids if i == tokens.family.marker_id)
        zeros = [0] * len(prompt_ids)
        prompt_ids = tokens.expand(prompt_ids, zeros, layouts[:k], tokenizer, where)[0]
    return replace(example, ids=ids, mask=mask, prompt_ids=prompt_ids, images=paths)
