"""Chat-template details of encoding: the assistant spans a template marks, and reasoning."""

from __future__ import annotations

import bisect
import re

from ..errors import UserInputError


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Rendering:
    """A conversation through a tokenizer's chat template. Each prefix of it (its first n
    messages, with the generation prompt or not) is rendered and tokenized at most once; the
    whole is tokenized once, with character offsets where the tokenizer is a fast one, so that
    where a prefix's rendering begins the whole one (as templates render) the tokens it shares
    are those ending within it, with no second tokenization. Tokens are what apply_chat_template
    gives: the rendering tokenized with no special tokens added, by the fast tokenizer's own
    (Rust) encoder where there is one."""

    def __init__(self, tmpl, messages: list, kwargs: dict, where: str):
        self.tmpl, self.messages, self.kwargs, self.where = tmpl, messages, kwargs, where
        self._texts: dict[tuple[int, bool], str] = {}
        self._tokens: dict[tuple[int, bool], list[int]] = {}
        self._backend = getattr(tmpl, "backend_tokenizer", None)
        whole = len(messages)
        if self._backend is not None:
            out = self._backend.encode(self.text(whole, False), add_special_tokens=False)
            self._tokens[whole, False] = out.ids
            self._ends = [end for _, end in out.offsets]
        self.ids = self.tokens(whole, False)
        """The whole conversation's tokens."""

    def render(self, messages: list, gen: bool = False, tokenize: bool = True, **kwargs):
        """apply_chat_template of ``messages`` (the conversation's template arguments, updated by
        ``kwargs``); a template that refuses them is an error at the row."""
        if not messages:
            return [] if tokenize else ""
        try:
            out = self.tmpl.apply_chat_template(
                messages,
                tokenize=tokenize,
                add_generation_prompt=gen,
                return_dict=False,
                **{**self.kwargs, **kwargs},
            )
        except Exception as e:  # jinja raises for conversations a template refuses
            raise UserInputError(
                f"the chat template refused this conversation: {e}", self.where
            ) from None
        return list(out) if tokenize else out

    def text(self, n: int, gen: bool) -> str:
        """The first n messages rendered."""
        if (n, gen) not in self._texts:
            self._texts[n, gen] = self.render(self.messages[:n], gen=gen, tokenize=False)
        return self._texts[n, gen]

    def tokens(self, n: int, gen: bool = False) -> list[int]:
        """The first n messages rendered and tokenized on their own."""
        if (n, gen) not in self._tokens:
            if not n:
                self._tokens[n, gen] = []
            elif self._backend is not None:
                text = self.text(n, gen)
                self._tokens[n, gen] = self._backend.encode(text, add_special_tokens=False).ids
            else:
                self._tokens[n, gen] = self.render(self.messages[:n], gen=gen)
        return self._tokens[n, gen]

    def shared(self, n: int, gen: bool = False) -> int:
        """How many leading tokens of the whole conversation the first n messages hold."""
        if n == len(self.messages) and not gen:
            return len(self.ids)
        if self._backend is not None and self.text(len(self.messages), False).startswith(
            self.text(n, gen)
        ):
            return bisect.bisect_right(self._ends, len(self.text(n, gen)))
        return common_prefix(self.tokens(n, gen), self.ids)


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""How a chat template marks what the assistant says (transformers' {% generation %} block)."""


def marked_assistant_mask(tmpl, messages: list, ids: list[int], kwargs: dict) -> list[int] | None:
    """The assistant mask a chat template marks with {% generation %} blocks (transformers'
    return_assistant_tokens_mask), when it has them and renders ``ids`` alike; else None (the
    tokens of each assistant turn are then found by rendering the conversation's prefixes)."""
    if not GENERATION_BLOCK.search(getattr(tmpl, "chat_template", None) or ""):
        return None
    try:
        out = tmpl.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kwargs,
        )
    except ValueError:  # a tokenizer without offsets (not a fast one) cannot map the blocks
        return None
    if list(out["input_ids"]) != ids:
        return None
    return [int(m) for m in out["assistant_masks"]]


REASONING_KEYS = ("reasoning_content", "thinking")
"""The fields an assistant message may carry its reasoning in (chat templates read one or the
other: Qwen3's and DeepSeek's reasoning_content, others thinking)."""


def with_reasoning(messages: list, where: str) -> tuple[list, list[int]]:
    """(messages, the indices of assistant turns with reasoning): each such turn's reasoning
    under both REASONING_KEYS, so that a template reading either shows it."""
    out, found = list(messages), []
    for i, m in enumerate(messages):
        given = [k for k in REASONING_KEYS if m.get(k) is not None]
        if not given:
            continue
        value = m[given[0]]
        if not isinstance(value, str):
            raise UserInputError(f"{given[0]} must be a string", f"{where} (messages[{i}])")
        if m["role"] != "assistant":
            raise UserInputError(
                f"{given[0]} belongs to an assistant turn, not a {m['role']!r} one",
                f"{where} (messages[{i}])",
            )
        if value.strip():
            out[i] = {**m, **dict.fromkeys(REASONING_KEYS, value)}
            found.append(i)
    return out, found
