"""Reasoning in chat data: an assistant turn's ``reasoning_content`` (or ``thinking``) reaches the
chat template, which shows it before the answer; ``data.train_on_reasoning`` says whether it is
trained on or is context only. The templates are written in the layouts of Qwen3's (``<think>``
blocks, reading reasoning_content) and of one reading ``thinking``."""

import pytest
from test_tool_calls import QWEN_STYLE, spans

from mlxtune.data import Encoder
from mlxtune.errors import UserInputError

QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{%- endif %}{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
THINKING_STYLE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.thinking %}[thought] {{ message.thinking }} [/thought]\n{%- endif %}"
    "{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
THOUGHT = "the sky scatters short waves most"
ANSWER = "blue"


def conversation(key="reasoning_content"):
    return [
        {"role": "user", "content": "what colour is the sky?"},
        {"role": "assistant", "content": ANSWER, key: THOUGHT},
    ]


def load(tokenizer_dir, template):
    from mlxtune.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir, chat_template=template)


def trained_and_context(tok, ex):
    trained = " ".join(spans(tok, ex))
    context = tok.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if not m])
    return trained, context


@pytest.mark.parametrize("template", [QWEN3_STYLE, THINKING_STYLE])
@pytest.mark.parametrize("key", ["reasoning_content", "thinking"])
def test_reasoning_reaches_the_template_and_trains_with_the_answer(tokenizer_dir, template, key):
    tok = load(tokenizer_dir, template)
    ex = Encoder(tok).encode({"messages": conversation(key)}, "chat", "f:1")
    # what transformers renders for the field the template reads
    field = "thinking" if template is THINKING_STYLE else "reasoning_content"
    want = tok._tokenizer.apply_chat_template(conversation(field), tokenize=True, return_dict=False)
    assert ex.ids == list(want)
    trained, context = trained_and_context(tok, ex)
    assert len(spans(tok, ex)) == 1  # the turn, reasoning and answer together
    assert "scatters" in trained and ANSWER in trained and "scatters" not in context


@pytest.mark.parametrize("template", [QWEN3_STYLE, THINKING_STYLE])
def test_reasoning_as_context_only_trains_the_answer(tokenizer_dir, template):
    tok = load(tokenizer_dir, template)
    on = Encoder(tok).encode({"messages": conversation()}, "chat", "f:1")
    off = Encoder(tok, train_on_reasoning=False).encode({"messages": conversation()}, "chat", "f:1")
    assert off.ids == on.ids  # the model still reads the reasoning
    trained, context = trained_and_context(tok, off)
    assert ANSWER in trained and "scatters" not in trained and "scatters" in context
    # only the reasoning's tokens (and the turn's opening before it) leave the targets
    dropped = [i for i, (a, b) in enumerate(zip(on.mask, off.mask, strict=True)) if a != b]
    assert all(on.mask[i] == 1 and off.mask[i] == 0 for i in dropped)
    assert "scatters" in tok.decode([on.ids[i] for i in dropped])
    assert ANSWER not in tok.decode([on.ids[i] for i in dropped])


def test_a_template_that_shows_no_reasoning_is_refused(tokenizer_dir):
    tok = load(tokenizer_dir, QWEN_STYLE)  # renders content only
    with pytest.raises(UserInputError, match="f:3: the row's assistant turns carry reasoning"):
        Encoder(tok).encode({"messages": conversation()}, "chat", "f:3")
    # without reasoning the same template is fine, and empty reasoning counts as none
    Encoder(tok).encode({"messages": conversation()[:1] + [conversation()[1] | {
        "reasoning_content": " "}]}, "chat", "f:4")  # fmt: skip


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "assistant", "content": "x", "reasoning_content": 3}, "must be a string"),
        ({"role": "user", "content": "x", "thinking": "hm"}, "belongs to an assistant turn"),
    ],
)
def test_bad_reasoning_is_named(tokenizer_dir, message, error):
    tok = load(tokenizer_dir, QWEN3_STYLE)
    msgs = [{"role": "user", "content": "q"}, message, {"role": "assistant", "content": "a"}]
    with pytest.raises(UserInputError, match=rf"f:5 \(messages\[1\]\): .*{error}"):
        Encoder(tok).encode({"messages": msgs}, "chat", "f:5")


def test_preference_pairs_keep_reasoning_as_the_recipe_says(tokenizer_dir):
    from mlxtune.data.formats import Pair
    from mlxtune.data.preference import PairEncoder

    tok = load(tokenizer_dir, QWEN3_STYLE)
    prompt = conversation()[:1]
    chosen = [conversation()[1]]
    rejected = [{"role": "assistant", "content": "green", "reasoning_content": "grass is green"}]
    pair = Pair(prompt, chosen, rejected)
    on = PairEncoder(tok).encode(pair, "f:1")
    off = PairEncoder(tok, train_on_reasoning=False).encode(pair, "f:1")
    scored = lambda ids, mask: tok.decode([t for t, m in zip(ids, mask, strict=True) if m])  # noqa: E731
    assert "scatters" in scored(on.ids, on.mask) and "grass" in scored(
        on.rejected_ids, on.rejected_mask
    )
    assert "scatters" not in scored(off.ids, off.mask) and ANSWER in scored(off.ids, off.mask)
    assert "grass" not in scored(off.rejected_ids, off.rejected_mask)


def test_a_recipe_keeps_reasoning_as_context(tmp_path, data_dir, llama_dir):
    """data.train_on_reasoning: false reaches the encoder of an SFT run."""
    import json

    from test_resume import trainer

    from conftest import tiny_recipe

    rows = [{"messages": conversation()} for _ in range(6)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"train": str(tmp_path / "r.jsonl"), "valid_size": 1, "max_length": 512}
    tok = {"chat_template": QWEN3_STYLE}
    on = trainer(tiny_recipe(data_dir, llama_dir, data=data, tokenizer=tok), tmp_path / "a")
    off = trainer(
        tiny_recipe(data_dir, llama_dir, data={**data, "train_on_reasoning": False}, tokenizer=tok),
        tmp_path / "b",
    )
    a, b = on.train_set.examples[0], off.train_set.examples[0]
    assert a.ids == b.ids and sum(b.mask) < sum(a.mask)
    assert "scatters" not in on.tokenizer.decode(
        [t for t, m in zip(b.ids, b.mask, strict=True) if m]
    )
