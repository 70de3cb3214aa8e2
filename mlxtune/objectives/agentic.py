"""Multi-turn rollouts with tools: each conversation alternates the model's turns (decoded in a
KV cache kept across turns, ``turns.converse``) with its tool calls' results or an environment's
messages, up to ``max_turns`` turns and ``max_rollout_length`` tokens after the prompt. What the
tools and the environment say is context, never a target: the loss covers the model's turns.

The context after a turn is the chat template's own markup: the template renders a probe
conversation with a marker as the assistant's text, once alone and once followed by the new
messages with the generation prompt; the text after the marker (the turn's end) and what the
second rendering adds are the tokens the model reads before its next turn. The model's turn is
kept as it wrote it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..data.prompts import PromptEncoder, PromptExample
from ..distributed import collectives, current
from ..errors import UserInputError
from ..generate import Sampling, decode_answer, eos_ids
from ..rewards import Reward, load_user, score
from ..tools import SENTINEL, Toolbox, parse_calls, template_format, tool_schema
from ..turns import converse
from .rollout import gather_completions, gather_floats, reward_means

PROBE = [{"role": "user", "content": "?"}]


def recipe_tools(recipe) -> tuple[dict, list[dict]]:
    """(the recipe's tool functions by name, their schemas); a function that cannot be imported
    or described is a ``UserInputError`` naming its key."""
    cfg = recipe.objective
    functions, schemas = {}, []
    for i, ref in enumerate(getattr(cfg, "tools", None) or []):
        key = f"objective.tools[{i}]"
        fn = load_user(ref, recipe, key, "tool")
        schema = tool_schema(fn, key)
        name = schema["function"]["name"]
        if name in functions:
            raise UserInputError(f"a second tool named {name!r}", key)
        functions[name] = fn
        schemas.append(schema)
    return functions, schemas


@dataclass
class Talk:
    """One conversation's host side: its messages after the prompt, its environment, the reward
    the environment gave, and its counts."""

    env: object | None = None
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    calls: int = 0
    errors: int = 0


class Agent:
    """The recipe's tools and environment, and the chat template's markup around turns, for
    one objective's rollouts."""

    def __init__(self, recipe, components):
        cfg, d = recipe.objective, recipe.data
        self.max_prompt = d.max_length
        functions, self.schemas = recipe_tools(recipe)
        self.cfg = cfg
        self.enc = encoder = PromptEncoder(
            components.tokenizer, d.add_eos, d.chat_template_kwargs, self.schemas
        )
        self.toolbox = Toolbox(functions, cfg.tool_timeout_s) if functions else None
        self.environment = (
            load_user(cfg.environment, recipe, "objective.environment", "environment class")
            if cfg.environment
            else None
        )
        if self.environment is not None and not all(
            callable(getattr(self.environment, m, None)) for m in ("reset", "step")
        ):
            raise UserInputError(
                f"{cfg.environment} needs reset(row) and step(message) methods",
                "objective.environment",
            )
        tok = components.tokenizer
        self.tok = tok
        template = encoder.template("objective.tools")
        self.format = (
            template_format(getattr(template, "chat_template", None))
            if cfg.tool_format == "auto"
            else cfg.tool_format
        )
        self.eos = eos_ids(tok)
        self.eos_text = [tok.decode([t]) for t in sorted(self.eos)]
        first = self._render(PROBE + [{"role": "assistant", "content": SENTINEL}], False)
        at = first.find(SENTINEL)
        if at < 0:
            raise UserInputError(
                "the chat template does not show an assistant turn's text as written: it cannot "
                "mark where a turn ends for multi-turn rollouts",
                "objective.tools" if cfg.tools else "objective.environment",
            )
        self._first = first
        self._tail = first[at + len(SENTINEL) :]
        if cfg.tools:  # the template takes a tool's message after a turn
            probe = {"role": "tool", "name": "probe", "tool_call_id": "000000000", "content": "1"}
            self.context([probe], "objective.tools")
        else:
            self.context([{"role": "user", "content": "1"}], "objective.environment")

    def _render(self, messages: list, gen: bool, where: str = "objective.tools") -> str:
        return self.enc.render(messages, where, gen, tokenize=False, tools=self.schemas or None)

    def context(self, messages: list[dict], where: str = "objective.environment") -> list[int]:
        """The tokens after a turn's text that show ``messages`` and open the model's next turn
        (the turn's end first: drop its first token where the model wrote it)."""
        whole = self._render(
            PROBE + [{"role": "assistant", "content": SENTINEL}] + messages, True, where
        )
        if not whole.startswith(self._first):
            raise UserInputError(
                "the chat template renders the earlier turns of a conversation differently once "
                "more messages follow; multi-turn rollouts append to what the model read",
                where,
            )
        text = self._tail + whole[len(self._first) :]
        return list(self.tok.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------ rollouts
    def start(self, prompts: list[PromptExample], group: int) -> tuple[list, list[Talk], int]:
        """(the prompts read, one a prompt or one a conversation, each conversation's host state,
        the group the prompts are read for)."""
        talks = [Talk() for _ in range(len(prompts) * group)]
        if self.environment is None:
            return [p.prompt_ids for p in prompts], talks, group
        ids = []
        for i, t in enumerate(talks):
            p = prompts[i // group]
            t.env = self._call("the environment", self.environment)
            row = {**p.fields, "prompt": p.prompt, "answer": p.answer}
            first = self._call("reset()", t.env.reset, row)
            if first is None:
                ids.append(p.prompt_ids)
                continue
            got = self.enc.prompt(first, f"{self.cfg.environment}: reset()")[0]
            ids.append(got[-self.max_prompt :])  # as data.overlong: truncate keeps a chat's end
        return ids, talks, 1

    def respond(self, talk: Talk, tokens: list[int], how: str, last: bool) -> list[int] | None:
        """The context after one of the model's turns: its tool calls' results, or the
        environment's answer; None where the conversation is over."""
        text = self.tok.decode(tokens, skip_special_tokens=False)
        if how == "eos":
            for e in self.eos_text:
                if e and text.endswith(e):
                    text = text[: -len(e)]
                    break
        content, calls = parse_calls(text, self.format)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
        talk.messages.append(message)
        if calls and self.toolbox is not None:
            if last:
                return None
            out = []
            for c in calls:
                result, bad = self.toolbox.run(c)
                talk.calls += 1
                talk.errors += bad
                out.append(
                    {"role": "tool", "name": c.name or "", "tool_call_id": c.id, "content": result}
                )
            talk.messages += out
            return self._tokens(out, tokens, how)
        if talk.env is None:
            return None
        got = self._call("step()", talk.env.step, message)
        try:
            messages, done, reward = got
            reward = None if reward is None else float(reward)
        except (TypeError, ValueError):
            raise UserInputError(
                f"step() returned {got!r:.200}; expected (messages, done, reward: a number or "
                "None)",
                "objective.environment",
            ) from None
        if reward is not None:
            talk.reward = (talk.reward or 0.0) + reward
        if done or not messages or last:
            return None
        talk.messages += list(messages)
        return self._tokens(list(messages), tokens, how)

    def _call(self, what: str, fn, *args):
        """``fn(*args)``, the environment's code: what it raises stops the run naming it."""
        try:
            return fn(*args)
        except Exception as e:
            raise UserInputError(
                f"{what} failed: {type(e).__name__}: {e}",
                f"objective.environment ({self.cfg.environment})",
            ) from None

    def _tokens(self, messages, turn: list[int], how: str) -> list[int]:
        ids = self.context(messages)
        if how == "eos" and ids and ids[0] == turn[-1]:
            ids = ids[1:]  # the turn's end, as the model wrote it
        return ids

    def run(self, model, prompts, group, keys, sampling: Sampling, stop, reuse=True):
        """Conversations from ``prompts`` (``group`` each): (their transcripts, host states)."""
        cfg = self.cfg
        read, talks, g = self.start(prompts, group)
        budget = self.budget()
        out = converse(
            model,
            read,
            g,
            keys,
            sampling,
            self.eos,
            cfg.max_completion_length,
            budget,
            lambda r, toks, how, last: self.respond(talks[r], toks, how, last),
            cfg.max_turns,
            stop=stop,
            reuse=reuse,
        )
        per_row = read if g == 1 else [x for x in read for _ in range(group)]
        return out, talks, per_row

    def budget(self) -> int:
        """Tokens a conversation may have after its prompt (the model's and the context's)."""
        cfg = self.cfg
        return cfg.max_rollout_length or cfg.max_turns * cfg.max_completion_length

    def final(self, transcript) -> list[int]:
        """The last turn's tokens (its end of turn left out)."""
        n = transcript.turns[-1]
        ids = transcript.tokens[len(transcript.tokens) - n :]
        return ids[:-1] if transcript.ended and ids and ids[-1] in self.eos else ids


def score_talks(
    agent: Agent,
    rewards: list[Reward],
    rows: list[PromptExample],
    transcripts,
    talks: list[Talk],
) -> tuple[np.ndarray, dict]:
    """(each conversation's reward, each function's values by label): the reward functions
    read the final turn as the completion and every message after the prompt as
    ``transcripts``; the environment's reward adds as ``environment``."""
    tok = agent.tok
    finals = [agent.final(t) for t in transcripts]
    total, each = [0.0] * len(rows), {}
    if rewards:
        fields = [
            {"answer": p.answer, **p.fields, "transcripts": t.messages}
            for p, t in zip(rows, talks, strict=True)
        ]
        texts = [decode_answer(tok, x) for x in finals]
        total, each = score(rewards, [p.prompt for p in rows], texts, finals, fields)
    total = np.array(total, np.float64)
    if agent.environment is not None:
        env = [t.reward for t in talks]
        total += np.array([0.0 if v is None else v for v in env])
        each["environment"] = env
    return total, each


def gather_rows(
    world, rows: int, where, width: int, tokens: dict, values: dict
) -> tuple[dict, dict]:
    """Every rank's per-row results, all ``rows`` in order (rank r holds rows ``where``):
    ``tokens`` maps a name to token lists (at most ``width`` each), and ``values`` a name to
    numbers or None."""
    if world.size == 1:
        return tokens, values
    out_tokens = {k: gather_completions(world, v, rows, where, width) for k, v in tokens.items()}
    names = sorted(values)
    table = np.zeros((rows, 2 * len(names)), np.float64)
    for c, k in enumerate(names):
        for r, v in zip(where, values[k], strict=True):
            if v is not None:
                table[r, 2 * c], table[r, 2 * c + 1] = float(v), 1.0
    got = world.all_sum(mx.array(table.astype(np.float32)))
    with collectives(world):
        mx.eval(got)
    got = np.array(got, np.float64)
    out_values = {
        k: [got[r, 2 * c] if got[r, 2 * c + 1] > 0 else None for r in range(rows)]
        for c, k in enumerate(names)
    }
    return out_tokens, out_values


def rollouts(obj, prompts: list[PromptExample], seed: int):
    """GRPO's batch of conversations: (transcript tokens, written masks, whether each ended, group
    sizes, rewards, host metrics, each row's prompt tokens). Data-parallel ranks converse their
    share of the prompts (each row from its own key), score them, and gather them all."""
    cfg, model, agent = obj.config, obj.components.model, obj.agent
    mx.eval(model.parameters())  # the queued step, before the clock starts
    t0 = time.perf_counter()
    g = cfg.num_generations
    keys = mx.random.split(mx.random.key(seed), len(prompts) * g)
    world = current()
    share = np.array_split(np.arange(len(prompts)), world.size)[world.rank]
    rows = (share[:, None] * g + np.arange(g)).reshape(-1)
    mine = [prompts[i] for i in share]
    transcripts, talks, read = agent.run(
        model, mine, g, keys[mx.array(rows)] if world.size > 1 else keys, obj.sampling, obj.stop
    )
    took = time.perf_counter() - t0
    total, each = score_talks(
        agent, obj.rewards, [p for p in mine for _ in range(g)], transcripts, talks
    )
    values = {
        "reward": list(total),
        "ended": [float(t.ended) for t in transcripts],
        "turns": [float(len(t.turns)) for t in transcripts],
        "tool_calls": [float(t.calls) for t in talks],
        "tool_errors": [float(t.errors) for t in talks],
        **{f"each/{k}": v for k, v in each.items()},
    }
    tokens = {
        "tokens": [t.tokens for t in transcripts],
        "written": [t.written for t in transcripts],
        "read": read,
    }
    drawn = [t.logps for t in transcripts]
    if world.size > 1:
        drawn = gather_floats(world, drawn, len(prompts) * g, rows, agent.budget() + 1)
    width = agent.budget() + obj.recipe.data.max_length + 1
    tokens, values = gather_rows(world, len(prompts) * g, rows, width, tokens, values)
    ended = [bool(v) for v in values["ended"]]
    rewards = np.array(values["reward"], np.float64)
    host: dict = {}
    made = sum(sum(w) for w in tokens["written"])
    host["generation_s"] = (took, obj._steps_per_rollout() / obj._batches_per_rollout())
    host["generation_tokens_per_sec"] = (made, took)  # as single-turn generation counts them
    n = len(ended)
    for k in ("turns", "tool_calls", "tool_errors"):
        host[k] = (float(sum(values[k])), n)
    reward_means(host, {k[5:]: v for k, v in values.items() if k.startswith("each/")})
    groups = [g] * len(prompts)
    obj._group_metrics(host, tokens["tokens"], ended, groups, rewards)
    out = tokens["tokens"], tokens["written"], ended, groups, rewards, host, tokens["read"]
    return (*out, drawn)


def transcript_text(tok, transcript) -> str:
    """A transcript as text, with the markup the model wrote and read."""
    return tok.decode(transcript.tokens, skip_special_tokens=False)


__all__ = [
    "Agent",
    "Talk",
    "gather_rows",
    "recipe_tools",
    "rollouts",
    "score_talks",
    "transcript_text",
]
