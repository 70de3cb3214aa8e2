"""Data formats: a registry of the shapes a JSONL row can take, and what each one trains on.

A format has a name, the keys a row of it needs (which is also how ``format: auto`` recognises
it), and a function that turns one row into *pieces* the encoder knows how to tokenize and mask:

- ``Text``: plain text, every token after the first a target;
- ``PromptAnswer``: a prompt (masked with ``data.mask_prompt``) and the answer trained on;
- ``Chat``: messages rendered by the tokenizer's chat template, assistant turns trained on
  (samples and exact-match rows show the last user message as the prompt; ShareGPT's
  ``conversations`` become messages too);
- ``Tokens``: token ids already, with an optional 0/1 mask;
- ``Pair``: a prompt with a preferred and a rejected completion (the preference objectives');
- ``Labeled``: a prompt and one completion marked desirable or not (KTO's unpaired feedback).

Adding a format is one call, e.g. for rows ``{"question": ..., "answer": ...}``::

    register_format(DataFormat(
        "qa", keys=("question", "answer"),
        pieces=lambda row, where: PromptAnswer(
            f"Q: {field(row, 'question', where)}\\nA:", " " + field(row, "answer", where)
        ),
    ))
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from ..errors import UserInputError

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


# ---------------------------------------------------------------------------------------- pieces


@dataclass(frozen=True)
class Text:
    """Plain text: every token after the first is a target."""

    text: str


@dataclass(frozen=True)
class PromptAnswer:
    """A prompt and its answer: the answer (and EOS, by the EOS rule) is trained on; the prompt
    too unless ``mask_prompt``. Both are kept on the example for generation and exact match.
    ``display`` is the prompt as samples and exact-match rows show it (the instruction, not the
    whole template around it); None shows ``prompt`` itself."""

    prompt: str
    answer: str
    display: str | None = None


@dataclass(frozen=True)
class Chat:
    """A conversation (``role``/``content`` dicts) for the tokenizer's chat template: the
    assistant turns are trained on (those from message ``first_trained`` on)."""

    messages: list
    first_trained: int = 0
    tools: list | None = None
    """The functions the conversation may call (JSON schemas), shown to the chat template."""
    images: tuple[str, ...] = ()
    """The image files the conversation shows, in order (each an ``{"type": "image"}`` part of
    a message's content): paths as the row gives them, relative to its data file."""


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
"""The roles a chat message may have (a chat template prints any other as written)."""


def check_messages(messages: list, where: str) -> None:
    """Refuse a message that is not a string ``role`` (one of ``CHAT_ROLES``) and ``content``
    (an assistant turn that calls tools may have none: it is taken as empty)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls"):
            m["content"] = ""
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str | list)
        ):
            raise UserInputError("each message needs a string 'role' and 'content'", where)
        if m["role"] not in CHAT_ROLES:
            raise UserInputError(
                f"unknown role {m['role']!r}; expected {', '.join(CHAT_ROLES)}",
                f"{where} (messages[{i}])",
            )


@dataclass(frozen=True)
class Tokens:
    """Token ids as they are, with a 0/1 mask (one per token) or None for "all but the first"."""

    ids: list[int]
    mask: Any = None


@dataclass(frozen=True)
class Pair:
    """A preference pair: a prompt and two completions of it, ``chosen`` preferred to
    ``rejected``. Each is a string, or (chat) a list of messages: the prompt's conversation and
    the completions' assistant turns. The preference objectives (``objective.type: dpo``,
    ``orpo``, ``cpo``, ``reward``) train on pairs; SFT refuses them."""

    prompt: str | list
    chosen: str | list
    rejected: str | list
    tools: list | None = None
    """The functions the conversation may call (chat pairs), shown to the chat template."""
    images: tuple[str, ...] = ()
    """The image files the prompt shows (chat pairs; see ``Chat.images``): both completions
    answer the same images."""


@dataclass(frozen=True)
class Labeled:
    """A prompt and one completion of it, ``label`` true when the completion is desirable (a
    thumbs-up) and false when not: unpaired feedback, which ``objective.type: kto`` trains on.
    Strings, or message lists as in ``Pair``."""

    prompt: str | list
    completion: str | list
    label: bool
    tools: list | None = None


Piece = Union[Text, PromptAnswer, Chat, Tokens, Pair, Labeled]


# --------------------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class DataFormat:
    """One data format.

    ``keys``: the keys a row of this format needs; a row that has all of them is detected as
    this format (so are rows with all the keys of one of ``alternatives``). ``pieces(row,
    where)`` turns a row into a ``Piece``, raising ``UserInputError`` at ``where`` (file:line)
    for a bad row. Formats are tried from the highest ``priority`` on (ties: the one
    registered first); the built-in ones have 10 to 50, so a format registered with the
    default is tried before them.
    """

    name: str
    keys: tuple[str, ...]
    pieces: Callable[[dict, str], Piece]
    alternatives: tuple[tuple[str, ...], ...] = ()
    priority: int = 100

    def matches(self, row: dict) -> bool:
        """Whether ``row`` has every key of ``keys`` or of one of ``alternatives``."""
        return any(all(k in row for k in ks) for ks in (self.keys, *self.alternatives))

    @property
    def hint(self) -> str:
        """The keys it needs, as error messages name the format: ``prompt+completion``."""
        return "+".join(self.keys)


_REGISTRY: dict[str, DataFormat] = {}


def register_format(fmt: DataFormat, replace: bool = False) -> DataFormat:
    """Make ``fmt`` known by its name (for ``data.format`` and for detection); returns it.
    A name already taken is an error unless ``replace``."""
    if fmt.name == "auto":
        raise ValueError("'auto' is not a format name: it asks for detection")
    if not fmt.keys:
        raise ValueError(f"format {fmt.name!r} needs at least one key to be detected by")
    if fmt.name in _REGISTRY and not replace:
        raise ValueError(f"a data format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> DataFormat:
    """Forget the format named ``name``; returns it (to register it again later)."""
    return _REGISTRY.pop(get_format(name).name)


def get_format(name: str) -> DataFormat:
    """The registered format named ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown data format {name!r}; known: {', '.join(format_names())}"
        ) from None


def format_names() -> tuple[str, ...]:
    """Names of the registered formats, in registration order."""
    return tuple(_REGISTRY)


def detect_format(obj: dict, where: str) -> str:
    """The name of the format ``obj``'s keys say it is: the first registered format, by
    priority, whose keys it has. None matching is an error at ``where`` listing them all."""
    for fmt in sorted(_REGISTRY.values(), key=lambda f: -f.priority):  # stable: ties in order
        if fmt.matches(obj):
            return fmt.name
    hints = [f.hint for f in _REGISTRY.values()]
    expected = " or ".join(hints) if len(hints) < 3 else f"{', '.join(hints[:-1])}, or {hints[-1]}"
    raise UserInputError(
        f"cannot tell the format from keys {sorted(obj)}: expected {expected}", where
    )


def field(obj: dict, key: str, where: str, kind: type = str) -> Any:
    """``obj[key]``, which must be there and be a ``kind``: else an error naming the key."""
    if key not in obj:
        raise UserInputError(f"missing field {key!r}", where)
    v = obj[key]
    if not isinstance(v, kind):
        raise UserInputError(
            f"field {key!r} must be a {kind.__name__}, got {type(v).__name__}", where
        )
    return v


# ------------------------------------------------------------------------------ built-in formats


def _text(obj: dict, where: str) -> Text:
    return Text(field(obj, "text", where))


def _completion(obj: dict, where: str) -> PromptAnswer | Chat:
    """A prompt and its completion: two strings, or (conversational, as TRL writes it) the
    prompt's messages and the completion's, which train as a chat on the completion's turns."""
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt = field(obj, "prompt", where, list)
        completion = field(obj, "completion", where, list)
        if not completion:
            raise UserInputError("'completion' holds no messages", where)
        chat = _chat({**obj, "messages": [*prompt, *completion]}, where)
        return Chat(chat.messages, first_trained=len(prompt), tools=chat.tools, images=chat.images)
    return PromptAnswer(field(obj, "prompt", where), field(obj, "completion", where))


def _instruction(obj: dict, where: str) -> PromptAnswer:
    inst = field(obj, "instruction", where)
    extra = obj.get("input") or ""  # "input" is optional; null or "" means none
    if not isinstance(extra, str):
        raise UserInputError("field 'input' must be a string", where)
    prompt = (ALPACA_PROMPT_INPUT if extra else ALPACA_PROMPT).format(instruction=inst, input=extra)
    display = f"{inst}\n{extra}" if extra else inst
    return PromptAnswer(prompt, field(obj, "output", where), display)


def _chat(obj: dict, where: str) -> Chat:
    messages = _calls_as_objects(field(obj, "messages", where, list), where)
    messages, images = chat_images(messages, obj.get("images", obj.get("image")), where)
    return Chat(messages, tools=read_tools(obj.get("tools"), where), images=images)


def chat_images(messages: list, column, where: str) -> tuple[list, tuple[str, ...]]:
    """A conversation's images, and its messages as chat templates read them.

    Images come as content parts, ``{"type": "image", "image": PATH}`` (or ``"path"``), or as
    an ``images`` column beside the messages (a list of paths, or one), which fills the
    conversation's bare ``{"type": "image"}`` parts in order or, when it has none, is shown at
    the start of the first user turn (as vision datasets that keep images in a column mean).
    A message's text parts are joined into one string where it holds no image."""
    if column is not None and not isinstance(column, list):
        column = [column]
    if column is not None and not all(isinstance(p, str) and p for p in column):
        raise UserInputError("'images' must be a list of image paths", where)
    named, bare, out = [], 0, []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        at = f"{where} (messages[{i}])"
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                path = part.get("image", part.get("path"))
                if path is None:
                    bare += 1
                elif isinstance(path, str) and path:
                    named.append(path)
                else:
                    raise UserInputError("an image part's 'image' is a file path", at)
                parts.append({"type": "image"})
            else:
                raise UserInputError(
                    "a message's content is a string, or a list of parts "
                    '{"type": "text", "text": ...} and {"type": "image", "image": PATH}',
                    at,
                )
        if all(p["type"] == "text" for p in parts):
            out.append({**m, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({**m, "content": parts})
    if named and (bare or column):
        raise UserInputError(
            "give every image as a path in its content part, or every one in the 'images' "
            "column, not both",
            where,
        )
    if named:
        return out, tuple(named)
    if column is None:
        if bare:
            raise UserInputError(
                f"the conversation shows {bare} image(s) and names no file: give each image "
                "part an 'image' path, or the row an 'images' column",
                where,
            )
        return out, ()
    if bare and bare != len(column):
        raise UserInputError(
            f"the conversation shows {bare} image(s) and the 'images' column names {len(column)}",
            where,
        )
    if not bare and column:
        first = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
        if first is None:
            raise UserInputError("the row has images and no user turn to show them in", where)
        m = out[first]
        text = m["content"] if isinstance(m["content"], str) else None
        parts = [{"type": "image"} for _ in column]
        parts += [{"type": "text", "text": text}] if text is not None else m["content"]
        out[first] = {**m, "content": parts}
    return out, tuple(column)


def _calls_as_objects(messages: list, where: str) -> list:
    """``messages`` with each assistant turn's ``tool_calls`` read (see ``_tool_calls``)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("tool_calls") is not None:
            m["tool_calls"] = _tool_calls(m["tool_calls"], f"{where} (messages[{i}])")
    return messages


def _json_or(value, where: str, what: str):
    """``value``, or the JSON a string holds (datasets often store these columns as strings)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise UserInputError(f"{what} is a string but not JSON ({e.msg})", where) from None
    return value


def read_tools(value, where: str) -> list | None:
    """A row's ``tools``: a list of function schemas (or a JSON string of one)."""
    if value is None:
        return None
    tools = _json_or(value, where, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserInputError("tools must be a list of objects (function schemas)", where)
    return tools or None


def _tool_calls(value, where: str) -> list:
    """An assistant turn's ``tool_calls``, each call's arguments as an object: given as a JSON
    string (OpenAI's form) or as an object, templates then render them alike."""
    calls = _json_or(value, where, "tool_calls")
    if not isinstance(calls, list):
        raise UserInputError("tool_calls must be a list", where)
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise UserInputError("each tool call is an object", where)
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            args = _json_or(fn["arguments"], where, "a tool call's arguments")
            if not isinstance(args, dict):
                raise UserInputError("a tool call's arguments must be an object", where)
            call["function"] = {**fn, "arguments": args}
        out.append(call)
    return out


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
"""ShareGPT's speakers ("from") as chat roles."""


def _sharegpt(obj: dict, where: str) -> Chat:
    """``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}`` as chat messages."""
    messages = []
    for i, turn in enumerate(field(obj, "conversations", where, list)):
        at = f"{where} (conversations[{i}])"
        if not isinstance(turn, dict):
            raise UserInputError(f"a turn is an object, got {type(turn).__name__}", at)
        speaker = field(turn, "from", at)
        if speaker not in SHAREGPT_ROLES:
            raise UserInputError(
                f"unknown speaker {speaker!r}; expected {', '.join(SHAREGPT_ROLES)}", at
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": field(turn, "value", at)})
    return Chat(messages)


def _tokens(obj: dict, where: str) -> Tokens:
    key = "input_ids" if "input_ids" in obj else "tokens"
    ids = field(obj, key, where, list)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise UserInputError(f"field {key!r} must be a list of non-negative integers", where)
    # An empty "mask" counts as none, as does a missing one.
    return Tokens(list(ids), obj.get("mask") or obj.get("loss_mask"))


def _texts_or_messages(obj: dict, keys: tuple[str, ...], where: str) -> list:
    """The fields ``keys`` of ``obj``, each a string or a list of messages: a missing one, or
    one of another type, is an error naming it (checked in the order given)."""
    for key in keys:
        if key not in obj:
            raise UserInputError(f"missing field {key!r}", where)
        if not isinstance(obj[key], (str, list)):
            raise UserInputError(
                f"field {key!r} must be a string or a list of messages, got "
                f"{type(obj[key]).__name__}",
                where,
            )
    return [obj[key] for key in keys]


def _preference(obj: dict, where: str) -> Pair:
    chosen, rejected = _texts_or_messages(obj, ("chosen", "rejected"), where)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, (str, list)):
            raise UserInputError(
                f"field 'prompt' must be a string or a list of messages, got "
                f"{type(prompt).__name__}",
                where,
            )
    elif isinstance(chosen, list) and isinstance(rejected, list):
        # the implicit prompt: the messages both conversations share
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise UserInputError("the two conversations share no prompt messages", where)
    elif isinstance(chosen, str) and isinstance(rejected, str):
        # the implicit prompt of plain text: the text both share, cut at its last whitespace,
        # which starts the completions (a word both begin alike stays whole in them)
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        cut = max(chosen.rfind(c, 0, n) for c in " \n\t")
        if n == min(len(chosen), len(rejected)) or cut <= 0:
            raise UserInputError(
                "no 'prompt', and chosen and rejected share no words to take as one "
                "(or one is the other's beginning)",
                where,
            )
        prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
    else:
        raise UserInputError("missing field 'prompt'", where)
    kinds = {type(v) for v in (prompt, chosen, rejected)}
    if len(kinds) > 1:
        raise UserInputError(
            "'prompt', 'chosen' and 'rejected' must all be strings or all be message lists",
            where,
        )
    tools = read_tools(obj.get("tools"), where)
    images = ()
    if isinstance(prompt, list):
        prompt, chosen, rejected = (_calls_as_objects(m, where) for m in (prompt, chosen, rejected))
        prompt, images = chat_images(prompt, obj.get("images", obj.get("image")), where)
    elif tools:
        raise UserInputError(
            "the row has tools, which only a conversation (messages) shows the model", where
        )
    return Pair(prompt, chosen, rejected, tools, images)


def _unpaired(obj: dict, where: str) -> Labeled:
    label = field(obj, "label", where, bool)
    prompt, completion = _texts_or_messages(obj, ("prompt", "completion"), where)
    if type(prompt) is not type(completion):
        raise UserInputError(
            "'prompt' and 'completion' must both be strings or both be message lists", where
        )
    tools = read_tools(obj.get("tools"), where)
    if isinstance(prompt, list):
        prompt, completion = (_calls_as_objects(m, where) for m in (prompt, completion))
    elif tools:
        raise UserInputError(
            "the row has tools, which only a conversation (messages) shows the model", where
        )
    return Labeled(prompt, completion, label, tools)


# Registration order is the order error messages list them in; priority, the order detection
# tries them in (a row with "messages" is chat whatever else it has).
for _fmt in (
    DataFormat("text", ("text",), _text, priority=10),
    DataFormat("completion", ("prompt", "completion"), _completion, priority=20),
    DataFormat("instruction", ("instruction", "output"), _instruction, priority=30),
    DataFormat("chat", ("messages",), _chat, priority=50),
    DataFormat("sharegpt", ("conversations",), _sharegpt, priority=45),
    DataFormat("tokens", ("input_ids",), _tokens, alternatives=(("tokens",),), priority=40),
    DataFormat("preference", ("chosen", "rejected"), _preference, priority=60),
    DataFormat("unpaired", ("prompt", "completion", "label"), _unpaired, priority=65),
):
    register_format(_fmt)
del _fmt
_BUILT_IN = dict(_REGISTRY)


def only_built_in_formats() -> bool:
    """Whether every registered format is one of mlxtune's own, unchanged: what a format
    registered by a program does cannot be told from its name, so its data is never cached."""
    return _REGISTRY == _BUILT_IN
