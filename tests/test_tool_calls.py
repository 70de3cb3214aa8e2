"""Tool-calling chats: a row's ``tools`` reach the chat template (as transformers passes them),
an assistant turn's ``tool_calls`` are trained on with their arguments given as a JSON string or
as an object alike, ``tool`` turns are context, and a template that shows no tools is refused.
The template is written in the layout of Qwen2.5's (tools as JSON lines in the system turn, calls
as ``<tool_call>`` JSON, tool results as user turns in ``<tool_response>``)."""

import json

import pytest

from mlxtune.data import Encoder
from mlxtune.errors import UserInputError

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def conversation(arguments):
    return [
        {"role": "user", "content": "is it raining in paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "content": '{"rain": true}'},
        {"role": "assistant", "content": "yes, it is raining"},
    ]


@pytest.fixture
def tok(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir, chat_template=QWEN_STYLE)


def spans(tok, ex):
    """The decoded runs of trained tokens."""
    out, run = [], []
    for t, m in zip(ex.ids, ex.mask, strict=True):
        if m:
            run.append(t)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out + ([tok.decode(run)] if run else [])


def test_the_tools_column_reaches_the_template_and_only_assistant_turns_train(tok):
    enc = Encoder(tok)
    with_tools = enc.encode(
        {"messages": conversation({"city": "paris"}), "tools": TOOLS}, "chat", "f:1"
    )
    without = enc.encode({"messages": conversation({"city": "paris"})}, "chat", "f:2")
    rendered = tok._tokenizer.apply_chat_template(
        conversation({"city": "paris"}), tools=TOOLS, tokenize=True, return_dict=False
    )
    assert with_tools.ids == list(rendered)  # what transformers renders with the tools
    assert len(with_tools.ids) > len(without.ids)  # the schema is in the context
    context = tok.decode([t for t, m in zip(with_tools.ids, with_tools.mask, strict=True) if not m])
    # (the test's small vocabulary decodes what it lacks, "_" among it, as <unk>)
    assert "weather" in context and "the weather in a city" in context
    trained = spans(tok, with_tools)
    assert len(trained) == 2  # the call, then the answer; the tool's result is context
    assert "call" in trained[0] and "arguments" in trained[0] and "paris" in trained[0]
    assert "raining" in trained[1] and not any("true" in s for s in trained)


def test_arguments_as_a_json_string_or_an_object_encode_alike(tok):
    enc = Encoder(tok)
    as_object = enc.encode(
        {"messages": conversation({"city": "paris"}), "tools": TOOLS}, "chat", "f:1"
    )
    as_string = enc.encode(
        {"messages": conversation(json.dumps({"city": "paris"})), "tools": json.dumps(TOOLS)},
        "chat",
        "f:2",
    )  # OpenAI's arguments, and a tools column stored as a JSON string (as datasets keep it)
    assert as_string.ids == as_object.ids and as_string.mask == as_object.mask


def test_a_template_that_shows_no_tools_is_refused(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir, chat_template=NO_TOOLS)
    with pytest.raises(
        UserInputError, match="f:4: the row has tools, and the chat template does not show them"
    ):
        Encoder(tok).encode(
            {"messages": conversation({"city": "paris"}), "tools": TOOLS}, "chat", "f:4"
        )


def test_bad_tools_and_arguments_are_named(tok):
    enc = Encoder(tok)
    with pytest.raises(UserInputError, match="tools must be a list of objects"):
        enc.encode({"messages": conversation({"city": "x"}), "tools": {"name": "f"}}, "chat", "f:5")
    with pytest.raises(UserInputError, match="f:6 .*arguments is a string but not JSON"):
        enc.encode({"messages": conversation("{city: x"), "tools": TOOLS}, "chat", "f:6")


def test_chat_template_kwargs_reach_the_template(tok):
    """data.chat_template_kwargs: Qwen3's enable_thinking, read by the template."""
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    plain = Encoder(tok).encode({"messages": msgs}, "chat", "f:1")
    off = Encoder(tok, template_kwargs={"enable_thinking": False}).encode(
        {"messages": msgs}, "chat", "f:1"
    )
    assert "<think>" in off.prompt and "<think>" not in plain.prompt


def test_chat_template_kwargs_without_a_chat_format_are_named_as_inert(tmp_path):
    from conftest import load_minimal
    from mlxtune import config as R

    r = load_minimal(tmp_path, ["data.chat_template_kwargs={enable_thinking: false}"])
    assert R.inert_keys(r) == [] and r.data.chat_template_kwargs == {"enable_thinking": False}
    r = load_minimal(
        tmp_path,
        [
            "data.format=instruction",
            "data.chat_template_kwargs={enable_thinking: false}",
            "data.train_on_reasoning=false",
        ],
    )
    keys = [k for k, _ in R.inert_keys(r)]
    assert keys == ["data.chat_template_kwargs", "data.train_on_reasoning"]
    # completion rows may be conversations (TRL's conversational prompt-completion)
    r = load_minimal(
        tmp_path, ["data.format=completion", "data.chat_template_kwargs={enable_thinking: false}"]
    )
    assert R.inert_keys(r) == []
    r = load_minimal(tmp_path, ["objective.type=grpo", "data.train_on_reasoning=false"])
    assert "data.train_on_reasoning" in [k for k, _ in R.inert_keys(r)]


def test_chat_template_kwargs_reach_preference_and_prompt_rows(tok):
    """DPO's pairs and GRPO's prompts render through the template with the same arguments."""
    from mlxtune.data.formats import Pair
    from mlxtune.data.preference import PairEncoder
    from mlxtune.data.prompts import PromptEncoder

    prompt = [{"role": "user", "content": "hello"}]
    pair = Pair(
        prompt,
        [{"role": "assistant", "content": "hi there"}],
        [{"role": "assistant", "content": "go away"}],
    )
    plain = PairEncoder(tok).encode(pair, "f:1")
    off = PairEncoder(tok, template_kwargs={"enable_thinking": False}).encode(pair, "f:1")
    assert "<think>" in off.prompt and "<think>" not in plain.prompt
    _, text, _ = PromptEncoder(tok, template_kwargs={"enable_thinking": False}).prompt(
        prompt, "f:2"
    )
    assert text.endswith("<think>\n\n</think>\n\n")
    _, text, _ = PromptEncoder(tok).prompt(prompt, "f:2")
    assert "<think>" not in text
