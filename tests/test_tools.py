"""Multi-turn rollouts' parts: tool calls read in each template format (malformed ones become
errors the model reads), tools run with a time limit, and the decoder that keeps a batch's KV
cache across turns gives each row the tokens a model reading its whole transcript afresh gives
(greedy: the full model over the whole sequence, no cache; sampled: recomputing each turn)."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from conftest import REPO
from mlxtune.generate import Sampling, eos_ids, row_keys
from mlxtune.tools import Toolbox, ToolCall, parse_calls, template_format
from mlxtune.turns import converse


# ------------------------------------------------------------------------ parsing
def test_hermes_calls_are_read_and_removed_from_the_text():
    text = (
        'Let me see. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 4}"}</tool_call>'
    )
    content, calls = parse_calls(text, "hermes")
    assert content == "Let me see."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 2, "b": 3}, None),
        ("mul", {"a": 4}, None),
    ]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 2}}', "no </tool_call>"),
        ('<tool_call>{"arguments": {"a": 2}}</tool_call>', 'with a "name"'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be an object"),
    ],
)
def test_a_malformed_hermes_call_is_an_error_call(text, error):
    _, calls = parse_calls(text, "hermes")
    assert len(calls) == 1 and error in calls[0].error


def test_llama3_calls():
    one = parse_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3")
    assert one[0] == "" and (one[1][0].name, one[1][0].arguments) == ("add", {"a": 1, "b": 2})
    two = parse_calls(
        '{"name": "f", "parameters": {"s": "x;y"}}; {"name": "g", "parameters": {}}', "llama3"
    )
    assert [(c.name, c.arguments) for c in two[1]] == [("f", {"s": "x;y"}), ("g", {})]
    assert parse_calls("The answer is 4.", "llama3") == ("The answer is 4.", [])
    assert "not valid JSON" in parse_calls('{"name": "f", "parameters": {', "llama3")[1][0].error


def test_mistral_calls():
    content, calls = parse_calls(
        'ok[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": {}}]',
        "mistral",
    )
    assert content == "ok" and [c.name for c in calls] == ["add", "mul"]
    _, calls = parse_calls('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "mistral")
    assert (calls[0].name, calls[0].arguments, calls[0].error) == ("add", {"a": 1, "b": 2}, None)
    _, calls = parse_calls("[TOOL_CALLS]add[ARGS]{a: 1}", "mistral")
    assert calls[0].name == "add" and "not valid JSON" in calls[0].error


def test_the_format_is_read_from_the_template():
    assert template_format("{{ '<tool_call>' }}") == "hermes"
    assert template_format("[TOOL_CALLS] {{ x }}") == "mistral"
    assert template_format("{% if role == 'ipython' %}<|python_tag|>{% endif %}") == "llama3"
    assert template_format(None) == "hermes"


# ------------------------------------------------------------------------ running tools
def test_tools_run_and_errors_reach_the_model():
    def add(a, b):
        return a + b

    def boom():
        raise ZeroDivisionError("no")

    def slow():
        time.sleep(3)

    def table():
        return {"x": [1, 2]}

    box = Toolbox({"add": add, "boom": boom, "slow": slow, "table": table}, timeout=0.3)
    assert box.run(ToolCall("add", {"a": 2, "b": 5}, "id")) == ("7", False)
    assert box.run(ToolCall("table", {}, "id")) == ('{"x": [1, 2]}', False)
    assert box.run(ToolCall("boom", {}, "id")) == ("error: ZeroDivisionError: no", True)
    t0 = time.perf_counter()
    got = box.run(ToolCall("slow", {}, "id"))
    assert got == ("error: slow did not answer within 0.3 s", True)
    assert time.perf_counter() - t0 < 2
    assert box.run(ToolCall("add", {"c": 1}, "id"))[0].startswith("error: TypeError")
    assert box.run(ToolCall("nope", {}, "id")) == (
        "error: there is no tool named 'nope' (tools: add, boom, slow, table)",
        True,
    )
    assert box.run(ToolCall(None, {}, "id", "bad JSON")) == ("error: bad JSON", True)


# ------------------------------------------------------------------------ the decoder
@pytest.fixture(scope="module")
def reverse():
    from mlx_lm import load

    return load(str(REPO / "recipes" / "models" / "reverse-tiny"))


WORDS = ["hello", "ab", "abcdefg", "zq", "mississippi", "x"]


def answers(tok):
    """A respond() giving rows contexts of different lengths, ending some conversations."""

    def respond(r, tokens, how, last):
        if (r + len(tokens)) % 4 == 3:
            return None
        word = "abcdefghij"[: 1 + (3 * r + len(tokens)) % 7]
        return list(tok.encode(f" copy {word} =", add_special_tokens=False))

    return respond


def naive_turns(model, prompt, respond, r, eos, turn_tokens, budget, max_turns):
    """Greedy conversation with no cache: the model over the whole sequence for every token."""
    ids, out, written = list(prompt), [], []
    for turn in range(max_turns):
        drawn, how = [], "cut"
        for _ in range(min(turn_tokens, budget - len(out))):
            t = int(mx.argmax(model(mx.array([ids]))[0, -1]).item())
            drawn.append(t)
            ids.append(t)
            if t in eos:
                how = "eos"
                break
        out += drawn
        written += [1] * len(drawn)
        if how == "cut":
            break
        ctx = respond(r, drawn, how, turn == max_turns - 1)
        if ctx is None or turn == max_turns - 1 or len(out) + len(ctx) + 1 > budget:
            break
        out += ctx
        written += [0] * len(ctx)
        ids += ctx
    return out, written


def test_kept_caches_give_what_reading_the_whole_transcript_gives(reverse):
    """Greedy, in one batch (a group of 2 for each prompt): rows end their turns at different
    steps and read contexts of different lengths; every row's tokens are the no-cache model's,
    and the context tokens are marked as not written."""
    model, tok = reverse
    prompts = [list(tok.encode(f"reverse {w} =")) for w in WORDS]
    eos = eos_ids(tok)
    respond = answers(tok)
    got = converse(model, prompts, 2, row_keys(0, 6, 2), Sampling(), eos, 12, 90, respond, 4)
    turns = [len(t.turns) for t in got]
    assert max(turns) == 4 and min(turns) < 4  # some conversations end early
    for r, t in enumerate(got):
        want, written = naive_turns(model, prompts[r // 2], respond, r, eos, 12, 90, 4)
        assert t.tokens == want and t.written == written, r
        assert sum(t.turns) == sum(written)


def test_sampled_rows_draw_the_same_whatever_the_cache(reverse):
    """Sampled: the kept caches draw what recomputing each turn from the whole transcript draws,
    and a row draws the same alone as in the batch (each turn from its own key)."""
    model, tok = reverse
    prompts = [list(tok.encode(f"reverse {w} =")) for w in WORDS]
    eos, respond, s = eos_ids(tok), answers(tok), Sampling(temperature=1.0)
    keys = row_keys(7, 6, 2)
    kept = converse(model, prompts, 2, keys, s, eos, 10, 80, respond, 3)
    again = converse(model, prompts, 2, keys, s, eos, 10, 80, respond, 3, reuse=False)
    assert [t.tokens for t in kept] == [t.tokens for t in again]
    assert len({tuple(t.tokens) for t in kept}) > 6  # the rows differ
    alone = converse(
        model, [prompts[4]], 1, keys[9:10], s, eos, 10, 80, lambda r, *a: respond(9, *a), 3
    )
    assert alone[0].tokens == kept[9].tokens


def test_the_budget_ends_a_conversation_as_cut(reverse):
    model, tok = reverse
    prompts = [list(tok.encode("reverse abcdefg ="))]
    long = list(tok.encode(" copy abcdefghijklmnop =", add_special_tokens=False))
    got = converse(
        model, prompts, 1, row_keys(0, 1), Sampling(), eos_ids(tok), 12, 20,
        lambda *a: long, 4,
    )[0]  # fmt: skip
    # the first turn fits; its context and one more token would pass 20
    assert len(got.turns) == 1 and not got.ended and len(got.tokens) == got.turns[0]


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2"])
def test_models_with_their_own_caches_converse_as_the_whole_transcript_reads(family):
    """A sliding window (gemma3_text, a window of 4) and conv state (lfm2): each turn reads the
    row's whole transcript afresh into the model's own caches; greedy, every row's tokens are the
    no-cache model's, across turns of different lengths and contexts."""
    from test_family_generation import PROMPTS, model_of

    model = model_of(family, scale=4.0)
    eos = set(range(1, 40, 3))  # turns that end at different steps

    def respond(r, tokens, how, last):
        return None if (r + len(tokens)) % 4 == 3 else [5, 6, 8, 9][: 1 + (r + len(tokens)) % 4]

    got = converse(model, PROMPTS, 2, row_keys(0, 4, 2), Sampling(), eos, 6, 40, respond, 3)
    assert max(len(t.turns) for t in got) > 1
    for r, t in enumerate(got):
        want, written = naive_turns(model, PROMPTS[r // 2], respond, r, eos, 6, 40, 3)
        assert t.tokens == want and t.written == written, r
