"""Prompts for reinforcement learning: each row a prompt to complete, with the fields its reward
functions read (``answer`` and any other keys), or (offline) the completions already drawn and
their rewards.

- ``{"prompt": str | [messages], "answer": ..., <other keys>}``: online rows. A string prompt is
  read as written; a list of ``role``/``content`` messages through the tokenizer's chat template,
  with the assistant's turn opened (the generation prompt).
- ``{"prompt": ..., "responses": [str, ...], "rewards": [float, ...]}``: offline rows, a group of
  completions and their rewards, trained on as they are (no generation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserInputError
from .chat import common_prefix
from .encode import Dataset, Example, SplitStats
from .formats import check_messages, read_tools
from .parallel import encoded, workers_for
from .rows import BadRows

OFFLINE_KEYS = ("responses", "rewards")


@dataclass
class PromptExample(Example):
    """A prompt (``prompt_ids``, also ``ids``: nothing in it is a target), the row's other
    fields for the reward functions, and for offline rows the group's completions (token ids,
    EOS included where a completion ended) and rewards."""

    fields: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    """file:line of the row."""
    responses: list[list[int]] | None = None
    response_texts: list[str] | None = None
    rewards: list[float] | None = None
    ended: list[bool] | None = None
    """Offline: whether each response ended (EOS) rather than being cut at the length limit."""

    @property
    def n_targets(self) -> int:
        return 0


class PromptEncoder:
    """Encodes prompt rows for one tokenizer: strings as written, messages through the chat
    template with the generation prompt."""

    def __init__(
        self,
        tokenizer,
        add_eos: bool = True,
        template_kwargs: dict | None = None,
        tools: list | None = None,
    ):
        self.tok = tokenizer
        self.add_eos = add_eos
        # arguments the chat template reads (data.chat_template_kwargs: enable_thinking, ...)
        self.template_kwargs = dict(template_kwargs or {})
        self.eos = tokenizer.eos_token_id
        self.tools = list(tools or [])
        """Function schemas every prompt shows besides its row's own (objective.tools)."""

    def template(self, where: str):
        tmpl = self.tok._tokenizer if hasattr(self.tok, "_tokenizer") else self.tok
        if not getattr(tmpl, "chat_template", None):
            raise UserInputError(
                "a prompt given as messages needs a tokenizer with a chat template, and this "
                "one has none (a base model's, often): give the prompt as text, or set "
                "tokenizer.chat_template",
                where,
            )
        return tmpl

    def render(self, messages: list, where: str, gen: bool, tokenize: bool = True, tools=None):
        try:
            out = self.template(where).apply_chat_template(
                messages,
                tools=tools,
                tokenize=tokenize,
                add_generation_prompt=gen,
                return_dict=False,
                **self.template_kwargs,
            )
        except UserInputError:
            raise
        except Exception as e:  # jinja raises for conversations a template refuses
            raise UserInputError(
                f"the chat template refused this conversation: {e}", where
            ) from None
        return list(out) if tokenize else out

    def prompt(self, value, where: str, tools: list | None = None) -> tuple[list[int], str, str]:
        """(ids, the text the model reads, the prompt as rows show it). ``tools`` (the row's
        function schemas, and the encoder's ``tools``) reach the chat template; a template that
        does not show them, or a prompt given as a string, is refused."""
        tools = [*(tools or []), *self.tools] or None
        if isinstance(value, str):
            if not value:
                raise UserInputError("'prompt' is empty", where)
            if tools:
                raise UserInputError(
                    "the row has tools, which only a prompt given as messages shows the model",
                    where,
                )
            return list(self.tok.encode(value)), value, value
        if isinstance(value, list) and value:
            check_messages(value, where)
            users = [m for m in value if m["role"] == "user"]
            shown = (users or value)[-1]["content"]
            ids = self.render(value, where, gen=True, tools=tools)
            if tools and ids == self.render(value, where, gen=True):
                raise UserInputError(
                    "the row has tools, and the chat template does not show them to the model "
                    "(it renders the prompt alike without them); use a template that renders "
                    "tools",
                    where,
                )
            return ids, self.render(value, where, gen=True, tokenize=False, tools=tools), shown
        raise UserInputError("'prompt' must be a string or a list of role/content messages", where)

    def response(
        self, prompt_value, prompt_ids: list[int], text: str, where: str, tools=None
    ) -> list[int]:
        """A given completion's token ids after its prompt, ending with EOS (a string prompt:
        ``data.add_eos``; messages: the template's end of the assistant turn)."""
        if isinstance(prompt_value, str):
            ids = list(self.tok.encode(prompt_value + text))
            out = ids[common_prefix(prompt_ids, ids) :]
            if self.add_eos and self.eos is not None:
                out.append(self.eos)
        else:
            turn = [*prompt_value, {"role": "assistant", "content": text}]
            ids = self.render(turn, where, gen=False, tools=tools)
            out = ids[common_prefix(prompt_ids, ids) :]
        if not out:
            raise UserInputError("a response encodes to no tokens", where)
        return out


@dataclass
class PromptRows:
    """Encodes one prompt row to its ``PromptExample`` (None: dropped as too long), here or in
    an encoding process (``parallel.encoded`` hands it to each)."""

    enc: PromptEncoder
    offline: bool
    max_prompt: int
    max_completion: int
    overlong: str

    def encode(self, obj: dict, fmt: str, where: str) -> tuple[PromptExample | None, bool]:
        """(the example or None where it is dropped, whether its prompt was cut)."""
        if "prompt" not in obj:
            raise UserInputError(
                f"a prompt row needs a 'prompt' (keys here: {', '.join(map(str, obj)) or 'none'})",
                where,
            )
        offline = self.offline
        has = [k for k in OFFLINE_KEYS if k in obj]
        if offline and len(has) < 2 or not offline and has:
            raise UserInputError(
                "offline rows (the file's first row is one) need both 'responses' and 'rewards'"
                if offline
                else "this row gives responses, but the file's first row is a prompt to "
                "generate from: every row of a file is one kind",
                where,
            )
        tools = read_tools(obj.get("tools"), where)
        ids, text, shown = self.enc.prompt(obj["prompt"], where, tools)
        cut = len(ids) > self.max_prompt
        if cut:
            if self.overlong == "drop":
                return None, True
            ids = ids[-self.max_prompt :]
        answer = obj.get("answer")
        fields = {k: v for k, v in obj.items() if k not in ("prompt", *OFFLINE_KEYS)}
        ex = PromptExample(
            list(ids),
            [0] * len(ids),
            prompt=text,
            answer=answer if isinstance(answer, str) else None if answer is None else str(answer),
            prompt_ids=list(ids),
            display=shown,
            fields=fields,
            where=where,
        )
        if offline:
            _offline(ex, obj, self.enc, self.max_completion, where, tools)
        return ex, cut


def load_prompts(
    path: Path,
    enc: PromptEncoder,
    max_prompt: int,
    max_completion: int,
    overlong: str,
    columns: dict[str, str] | None = None,
    bad: BadRows | None = None,
    num_proc: int | str = 1,
) -> Dataset:
    """A JSONL file of prompt rows (all online or all offline, as the first row is). A prompt
    longer than ``max_prompt`` tokens keeps its last ``max_prompt`` tokens (``overlong:
    truncate``, as chat prompts keep their latest turns) or is dropped; offline responses are cut
    at ``max_completion`` tokens (a cut one did not end). ``num_proc`` processes encode it
    (``workers_for``)."""
    bad = bad or BadRows()
    rows = bad.read(path, columns)
    offline = any(k in rows[0][1] for k in OFFLINE_KEYS)
    stats = SplitStats(examples=len(rows), noun="prompts")
    out: list[PromptExample] = []
    row = PromptRows(enc, offline, max_prompt, max_completion, overlong)
    for _, got in encoded(row, rows, "prompt", path, workers_for(len(rows), num_proc)):
        with bad.row():
            if isinstance(got, UserInputError):
                raise got
            ex, cut = got
            if ex is None:
                stats.dropped_too_long += 1
                continue
            stats.truncated += cut
            out.append(ex)
            stats.tokens += len(ex.ids)
    bad.finish(stats, path)
    stats.kept = len(out)
    if not out:
        raise UserInputError(
            f"no prompt is left ({stats.line()}; {stats.examples} read): check data.max_length",
            str(path),
        )
    return Dataset(out, stats, str(path))


def _offline(
    ex: PromptExample, obj: dict, enc: PromptEncoder, limit: int, where: str, tools=None
) -> None:
    texts, rewards = obj["responses"], obj["rewards"]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise UserInputError("'responses' must be a non-empty list of strings", where)
    if (
        not isinstance(rewards, list)
        or len(rewards) != len(texts)
        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards)
    ):
        raise UserInputError(
            f"'rewards' must be {len(texts)} numbers, one for each response", where
        )
    ex.responses, ex.ended = [], []
    for t in texts:
        ids = enc.response(obj["prompt"], ex.prompt_ids, t, where, tools)
        ex.ended.append(len(ids) <= limit)
        ex.responses.append(ids[:limit])
    ex.response_texts = list(texts)
    ex.rewards = [float(r) for r in rewards]


__all__ = ["OFFLINE_KEYS", "PromptEncoder", "PromptExample", "load_prompts"]
