"""Heads on the final hidden state besides the LM head.

- The reward model's: one linear map to a score, kept on the model as ``score`` (the name
  Hugging Face's ``*ForSequenceClassification`` models give it, so a fused export loads there as
  is); exported with the model.
- PPO's value head (``value_head``): a linear map with a bias to each position's value, trained
  with the policy and kept in checkpoints, never exported (the policy is the product)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

REWARD_HEAD = "score"
VALUE_HEAD = "value_head"


def add_reward_head(model: nn.Module, hidden: int) -> nn.Linear:
    """A new trainable ``[1, hidden]`` score head on ``model`` (from MLX's random state)."""
    head = nn.Linear(hidden, 1, bias=False)
    head.weight = head.weight.astype(mx.float32)
    setattr(model, REWARD_HEAD, head)
    return head


def reward_head(model: nn.Module) -> nn.Linear | None:
    """The model's reward head, or None for a language model."""
    return model.get(REWARD_HEAD) if isinstance(model, dict) else None


def has_reward_head(weights: dict) -> bool:
    """Whether saved weights (flat names) hold a reward head."""
    return f"{REWARD_HEAD}.weight" in weights


def without_reward_head(weights: dict) -> dict:
    """Flat weights without the reward head's."""
    return {k: v for k, v in weights.items() if not k.startswith(f"{REWARD_HEAD}.")}


@contextlib.contextmanager
def reward_head_aside(model: nn.Module) -> Iterator[nn.Linear | None]:
    """The model without its reward head for the block (what language-model formats and
    quantization walk), the head yielded and put back after."""
    head = reward_head(model)
    if head is None:
        yield None
        return
    model.pop(REWARD_HEAD)
    try:
        yield head
    finally:
        setattr(model, REWARD_HEAD, head)


def add_value_head(model: nn.Module, hidden: int) -> nn.Linear:
    """A new trainable ``hidden -> 1`` value head on ``model``, starting at 0 everywhere."""
    head = nn.Linear(hidden, 1, bias=True)
    head.weight = mx.zeros((1, hidden), mx.float32)
    head.bias = mx.zeros((1,), mx.float32)
    setattr(model, VALUE_HEAD, head)
    return head


def value_head(model: nn.Module) -> nn.Linear | None:
    """The model's value head, or None."""
    return model.get(VALUE_HEAD) if isinstance(model, dict) else None


def without_value_head(weights: dict) -> dict:
    """Flat weights without the value head's."""
    return {k: v for k, v in weights.items() if not k.startswith(f"{VALUE_HEAD}.")}


@contextlib.contextmanager
def value_head_aside(model: nn.Module) -> Iterator[nn.Linear | None]:
    """The model without its value head for the block (what exports see)."""
    head = value_head(model)
    if head is None:
        yield None
        return
    model.pop(VALUE_HEAD)
    try:
        yield head
    finally:
        setattr(model, VALUE_HEAD, head)
