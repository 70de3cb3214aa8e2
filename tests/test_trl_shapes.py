"""Every dataset shape TRL documents reads without conversion: conversational prompt-completion
(trained on the completion's turns only), and preference pairs whose prompt is implicit, in
messages or in plain text."""

import json

import pytest
from test_tool_calls import QWEN_STYLE, TOOLS, conversation, spans

from mlxtune.data import Encoder
from mlxtune.data.formats import get_format
from mlxtune.errors import UserInputError


@pytest.fixture
def tok(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir, chat_template=QWEN_STYLE)


def test_conversational_prompt_completion_trains_on_the_completion_turns_only(tok):
    prior = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello friend"}]
    user = [{"role": "user", "content": "name a colour"}]
    answer = [{"role": "assistant", "content": "blue"}]
    enc = Encoder(tok)
    ex = enc.encode({"prompt": prior + user, "completion": answer}, "completion", "f:1")
    # the context is the whole conversation as the template renders it
    want = tok._tokenizer.apply_chat_template(
        prior + user + answer, tokenize=True, return_dict=False
    )
    assert ex.ids == list(want)
    assert len(spans(tok, ex)) == 1  # one trained run: the completion's turn
    trained = "".join(spans(tok, ex))
    assert "blue" in trained and "friend" not in trained  # the prompt's assistant turn: context
    # the same messages as a chat row train every assistant turn
    whole = enc.encode({"messages": prior + user + answer}, "chat", "f:2")
    assert whole.ids == ex.ids and "friend" in "".join(spans(tok, whole))


def test_a_conversational_completion_keeps_the_rows_tools(tok):
    msgs = conversation({"city": "paris"})
    ex = Encoder(tok).encode(
        {"prompt": msgs[:1], "completion": msgs[1:], "tools": TOOLS}, "completion", "f:1"
    )
    chat = Encoder(tok).encode({"messages": msgs, "tools": TOOLS}, "chat", "f:2")
    assert (ex.ids, ex.mask) == (chat.ids, chat.mask)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": [{"role": "user", "content": "x"}], "completion": []}, "holds no messages"),
        ({"prompt": [{"role": "user", "content": "x"}], "completion": "y"}, "must be a list"),
    ],
)
def test_bad_conversational_completions_are_named(tok, row, message):
    with pytest.raises(UserInputError, match=f"f:3.*{message}"):
        Encoder(tok).encode(row, "completion", "f:3")


def pair(row):
    return get_format("preference").pieces(row, "f:1")


def test_a_text_pair_without_a_prompt_takes_the_words_both_share():
    p = pair({"chosen": "Q: the sky is A: blue", "rejected": "Q: the sky is A: green"})
    assert (p.prompt, p.chosen, p.rejected) == ("Q: the sky is A:", " blue", " green")
    # a word both completions begin alike stays whole in them
    p = pair({"chosen": "reverse ab = ba", "rejected": "reverse ab = bb"})
    assert (p.prompt, p.chosen, p.rejected) == ("reverse ab =", " ba", " bb")
    explicit = pair({"prompt": "reverse ab =", "chosen": " ba", "rejected": " bb"})
    assert explicit == p


@pytest.mark.parametrize(
    "row",
    [
        {"chosen": "blue", "rejected": "black"},  # no whole word shared
        {"chosen": "the sky", "rejected": "the sky is blue"},  # one begins the other
        {"chosen": "same text", "rejected": "same text"},
    ],
)
def test_a_text_pair_with_no_prompt_to_take_is_refused(row):
    with pytest.raises(UserInputError, match="f:1: no 'prompt', and chosen and rejected share"):
        pair(row)


# ------------------------------------------------------------------ tools in pairs and prompts


def test_a_chat_pairs_tools_reach_the_template_for_both_completions(tok):
    from mlxtune.data.preference import PairEncoder

    msgs = conversation(json.dumps({"city": "paris"}))  # arguments as OpenAI's JSON string
    row = {
        "prompt": msgs[:3],
        "chosen": msgs[3:],
        "rejected": [{"role": "assistant", "content": "no idea"}],
        "tools": TOOLS,
    }
    ex = PairEncoder(tok).encode(pair(row), "f:1")
    # the chosen conversation as transformers renders it, the tools shown, the call's
    # arguments an object
    want = tok._tokenizer.apply_chat_template(
        conversation({"city": "paris"}), tools=TOOLS, tokenize=True, return_dict=False
    )
    assert ex.ids == list(want)
    assert tok.decode(ex.rejected_ids).count("get") == tok.decode(ex.ids).count("get")
    trained = tok.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if m])
    assert "raining" in trained and "paris" not in trained  # the call is in the prompt
    with pytest.raises(UserInputError, match="f:1: the row has tools, which only a conversation"):
        pair({"prompt": "q", "chosen": " a", "rejected": " b", "tools": TOOLS})


def test_a_prompts_tools_reach_the_template_and_a_string_prompt_refuses_them(tok):
    from mlxtune.data.prompts import PromptEncoder

    user = [{"role": "user", "content": "is it raining in paris?"}]
    enc = PromptEncoder(tok)
    ids, text, shown = enc.prompt(user, "f:1", TOOLS)
    want = tok._tokenizer.apply_chat_template(
        user, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(want) and "get_weather" in text and shown == user[0]["content"]
    assert len(ids) > len(enc.prompt(user, "f:1")[0])
    with pytest.raises(UserInputError, match="f:2: the row has tools, which only a prompt"):
        enc.prompt("is it raining?", "f:2", TOOLS)


def test_a_prompt_file_with_tools_through_a_template_that_hides_them_is_refused(
    tokenizer_dir, tmp_path
):
    from test_tool_calls import NO_TOOLS

    from mlxtune.data.prompts import PromptEncoder, load_prompts
    from mlxtune.tokenizer import load_tokenizer

    rows = [{"prompt": [{"role": "user", "content": "rain?"}], "tools": json.dumps(TOOLS)}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = load_prompts(
        path, PromptEncoder(load_tokenizer(tokenizer_dir, QWEN_STYLE)), 512, 8, "drop"
    )
    assert "get_weather" in ok.examples[0].prompt
    hidden = PromptEncoder(load_tokenizer(tokenizer_dir, chat_template=NO_TOOLS))
    with pytest.raises(UserInputError, match=r"p.jsonl:1: the row has tools, and the chat"):
        load_prompts(path, hidden, 512, 8, "drop")


# ------------------------------------------------------------------ the examples in docs/data.md

TOOLS_AND_REASONING = (
    "{%- if tools %}<|im_start|>system\n# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def readme_block(title, lang):
    from conftest import REPO

    text = (REPO / "docs" / "data.md").read_text()
    return text.split(title, 1)[1].split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def test_the_readmes_shapes_each_read_as_it_says(tokenizer_dir):
    """Every row of docs/data.md's "Shapes, one example each" encodes, as the format it names."""
    from mlxtune.data.formats import Pair, detect_format
    from mlxtune.data.preference import PairEncoder
    from mlxtune.data.prompts import PromptEncoder
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir, chat_template=TOOLS_AND_REASONING)
    rows = [json.loads(line) for line in readme_block("## Shapes, one example each", "json")
            .splitlines()]  # fmt: skip
    names = [detect_format(r, "README") if "answer" not in r else "prompt" for r in rows]
    assert names == [
        "text", "completion", "completion", "instruction", "chat", "chat", "chat", "sharegpt",
        "tokens", "preference", "preference", "preference", "unpaired", "prompt",
    ]  # fmt: skip
    for row, name in zip(rows, names, strict=True):
        if name == "preference":
            ex = PairEncoder(tok).encode(get_format(name).pieces(row, "README"), "README")
            assert ex.n_targets and ex.rejected_targets
        elif name == "unpaired":  # KTO's: a completion and its label
            piece = get_format(name).pieces(row, "README")
            pair = Pair(piece.prompt, piece.completion, piece.completion)
            assert piece.label is False and PairEncoder(tok).encode(pair, "README").n_targets
        elif name == "prompt":
            ids, _, shown = PromptEncoder(tok).prompt(row["prompt"], "README")
            assert ids and shown == "What is 2 + 2?"
        else:
            assert Encoder(tok).encode(row, name, "README").n_targets


def test_the_readmes_sources_are_recipe_data_sections():
    import yaml

    for line in readme_block("## Sources, one example each", "yaml").splitlines():
        data = yaml.safe_load(line)["data"]
        assert isinstance(data["train"], str)
