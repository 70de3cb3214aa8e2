"""Tools and environments for multi-turn rollouts: the recipe's Python functions as the chat
template's ``tools``, tool calls parsed from what the model wrote (in its template's format),
run with a time limit, and their results as the messages the model reads next.

- ``objective.tools: [FILE.py:function, ...]``: each function's signature and docstring (Google
  style: a summary, then ``Args:`` with a line for each parameter) become its JSON schema, as
  Hugging Face's chat templates take them.
- ``objective.environment: FILE.py:Class``: one instance a conversation; ``reset(row)`` gets the
  prompt row (a dict of its fields) and returns the first messages (or None: the row's own
  prompt), ``step(message)`` gets each assistant message that calls no tool of the recipe's
  (``{"role": "assistant", "content": ..., "tool_calls": [...]}``) and returns ``(messages,
  done, reward)``: the messages the model reads next, whether the conversation is over, and a
  number (or None) added to the conversation's reward.

Formats (``objective.tool_format``, ``auto`` reads the chat template): ``hermes`` (Qwen, Hermes:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number in a turn), ``llama3``
(a turn that is a JSON object ``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>``
where the model writes it; several joined by ``;``) and ``mistral`` (``[TOOL_CALLS]`` then a
JSON list of ``{"name", "arguments"}``, or ``name[ARGS]{...}``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

from .errors import UserInputError

FORMATS = ("hermes", "llama3", "mistral")
SENTINEL = "\u2063MLXTUNE-TURN\u2063"
"""The assistant content a template renders, to find where a turn's text sits in its markup."""


@dataclass
class ToolCall:
    """A call parsed from the model's turn: its tool's name and arguments, its id (the
    templates that pair results with calls read it), or why it could not be read."""

    name: str | None
    arguments: dict
    id: str
    error: str | None = None

    def message(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry."""
        return {
            "type": "function",
            "id": self.id,
            "function": {"name": self.name or "", "arguments": self.arguments},
        }


def call_id(text: str, k: int) -> str:
    """A 9-character alphanumeric id for call ``k`` of a turn (Mistral's templates ask for this
    form), the same for the same turn."""
    return hashlib.sha1(f"{k}:{text}".encode()).hexdigest()[:9]


def _arguments(value, where: str) -> dict:
    if isinstance(value, str):
        value = json.loads(value)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, not {type(value).__name__}")
    return value


def _call(obj, text: str, k: int, args_key: tuple[str, ...]) -> ToolCall:
    cid = call_id(text, k)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, cid, 'a tool call is a JSON object with a "name"')
    key = next((a for a in args_key if a in obj), None)
    try:
        args = _arguments(obj.get(key) if key else None, f'"{key}"')
    except (ValueError, json.JSONDecodeError) as e:
        return ToolCall(obj["name"], {}, cid, f"the arguments could not be read: {e}")
    return ToolCall(obj["name"], args, cid)


def _json(text: str, k: int, what: str):
    """``text`` as JSON, or a ToolCall saying why not."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, call_id(text, k), f"{what} is not valid JSON ({e})")


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(the turn's text without its calls, the calls) in format ``fmt``. A call that cannot be
    read is a ToolCall with its ``error``: the model is told, and the rollout goes on."""
    calls: list[ToolCall] = []
    if fmt == "hermes":
        for k, m in enumerate(_HERMES.finditer(text)):
            body = m.group(1).strip()
            if not m.group(0).endswith("</tool_call>"):
                calls.append(
                    ToolCall(None, {}, call_id(body, k), "the tool call has no </tool_call>")
                )
                continue
            got = _json(body, k, "the tool call")
            calls.append(got if isinstance(got, ToolCall) else _call(got, body, k, ("arguments",)))
        return _HERMES.sub("", text).strip(), calls
    if fmt == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return text.strip(), []
        for k, part in enumerate(p for p in _split_objects(body) if p.strip()):
            got = _json(part.strip(), k, "the tool call")
            keys = ("parameters", "arguments")
            calls.append(got if isinstance(got, ToolCall) else _call(got, part, k, keys))
        return "", calls
    if fmt == "mistral":
        head, sep, rest = text.partition("[TOOL_CALLS]")
        if not sep:
            return text.strip(), []
        pieces = [p.strip() for p in rest.split("[TOOL_CALLS]")]
        for k, piece in enumerate(pieces):
            if "[ARGS]" in piece:  # name[ARGS]{...}
                name, _, args = piece.partition("[ARGS]")
                got = _json(args.strip(), k, "the arguments")
                if isinstance(got, ToolCall):
                    got.name = name.strip() or None
                    calls.append(got)
                else:
                    calls.append(
                        _call({"name": name.strip(), "arguments": got}, piece, k, ("arguments",))
                    )
                continue
            got = _json(piece, k, "the tool calls")
            if isinstance(got, ToolCall):
                calls.append(got)
                continue
            for j, obj in enumerate(got if isinstance(got, list) else [got]):
                calls.append(_call(obj, piece, k * 64 + j, ("arguments",)))
        return head.strip(), calls
    raise ValueError(f"unknown tool format {fmt!r}")


def _split_objects(body: str) -> list[str]:
    """Top-level ``;``-separated pieces of ``body`` (a ``;`` inside a string or an object
    stays)."""
    out, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if quoted:
            escaped = not escaped and ch == "\\"
            if ch == '"' and not escaped:
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            out.append(body[start:i])
            start = i + 1
    out.append(body[start:])
    return out


def template_format(template: str | None) -> str:
    """The tool-call format a chat template's source shows (hermes where it shows none)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "hermes"


def tool_schema(fn: Callable, key: str) -> dict:
    """``fn``'s JSON schema from its signature and docstring, as chat templates take tools."""
    try:
        return get_json_schema(fn)
    except Exception as e:
        raise UserInputError(
            f"{getattr(fn, '__name__', fn)} cannot be shown to the model as a tool: {e} (a tool "
            "needs type hints and a docstring with an Args: line for each parameter)",
            key,
        ) from None


def _text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class Toolbox:
    """The recipe's tool functions by name, run one call at a time, each within ``timeout``
    seconds (a call still running then is left to finish on its own thread; the model is told
    it took too long)."""

    def __init__(self, functions: dict[str, Callable], timeout: float):
        self.functions, self.timeout = functions, timeout

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """(the result the model reads, whether it is an error)."""
        if call.error:
            return f"error: {call.error}", True
        fn = self.functions.get(call.name)
        if fn is None:
            known = ", ".join(sorted(self.functions)) or "none"
            return f"error: there is no tool named {call.name!r} (tools: {known})", True
        box: dict = {}

        def target():
            try:
                box["value"] = fn(**call.arguments)
            except Exception as e:  # the model reads what went wrong
                box["error"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=target, daemon=True, name=f"tool {call.name}")
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            return f"error: {call.name} did not answer within {self.timeout:g} s", True
        if "error" in box:
            return f"error: {box['error']}", True
        return _text(box.get("value")), False


__all__ = [
    "FORMATS",
    "SENTINEL",
    "ToolCall",
    "Toolbox",
    "call_id",
    "parse_calls",
    "template_format",
    "tool_schema",
]
