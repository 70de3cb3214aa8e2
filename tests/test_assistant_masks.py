"""Which tokens of a chat are trained on, token by token, against masks written out by hand:
through SmolLM2's own chat template and Llama-3's layout (no markings: each assistant turn is
found by rendering the conversation's prefixes), and through templates that mark the assistant's
words with {% generation %} blocks (the mask is the template's, as transformers'
return_assistant_tokens_mask gives it), a Qwen3-style one among them whose earlier turns drop
their reasoning, which prefixes alone cannot follow.

The tokenizer is a word-level one built here: every word, run of spaces or newlines, punctuation
mark and special token is one token, so the expected masks can be written as the tokens' text."""

import re

import pytest

from mlxtune.data import Encoder
from mlxtune.tokenizer import load_tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<think>", "</think>",
]  # fmt: skip
PIECES = re.compile("|".join(map(re.escape, SPECIAL)) + r"|\n+| +|\w+|[^\w\s]")

# SmolLM2-135M-Instruct's chat template, as its tokenizer_config.json (and its GGUF) holds it
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3's layout: a header per turn, <|eot_id|> ending it
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Qwen's layout with the assistant's words marked, as training templates mark them
QWEN_MARKED = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# Qwen3's layout: an assistant turn shows its reasoning only after the last user turn
QWEN3_MARKED = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{%- if message.reasoning_content and loop.index0 > ns.last %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content }}<|im_end|>{% endgeneration %}\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

CHAT = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello you"},
    {"role": "user", "content": "and now?"},
    {"role": "assistant", "content": "bye"},
]


def word_tokenizer(template, folder):
    """The word-level tokenizer, saved to ``folder`` and loaded as mlxtune loads a model's."""
    texts = [SMOLLM2, LLAMA3, QWEN_MARKED, QWEN3_MARKED, "You are a helpful AI assistant named "
             "SmolLM, trained by Hugging Face system user assistant hi there hello you and now "
             "bye think sky blue why because \n\n\n\n"]  # fmt: skip
    words = sorted({w for t in texts for w in PIECES.findall(t)} | set(SPECIAL) | {"[UNK]"})
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(PIECES.pattern), behavior="isolated"
    )
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        additional_special_tokens=SPECIAL,
    )
    fast.save_pretrained(folder)
    return load_tokenizer(folder, chat_template=template)


def trained_runs(tok, ex):
    """Each run of trained tokens, as the tokens' text."""
    runs, run = [], []
    for t, m in zip(ex.ids, ex.mask, strict=True):
        if m:
            run.append(tok._tokenizer.convert_ids_to_tokens(t))
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize(
    "template, expected",
    [
        (  # each turn's words, its <|im_end|> and the newline after it
            SMOLLM2,
            [["hello", " ", "you", "<|im_end|>", "\n"], ["bye", "<|im_end|>", "\n"]],
        ),
        (LLAMA3, [["hello", " ", "you", "<|eot_id|>"], ["bye", "<|eot_id|>"]]),
        # the marked blocks: the newline after <|im_end|> is outside them
        (QWEN_MARKED, [["hello", " ", "you", "<|im_end|>"], ["bye", "<|im_end|>"]]),
    ],
)
def test_the_trained_tokens_of_each_template(template, expected, tmp_path):
    tok = word_tokenizer(template, tmp_path)
    ex = Encoder(tok).encode({"messages": CHAT}, "chat", "f:1")
    want = tok._tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ex.ids == list(want)
    assert trained_runs(tok, ex) == expected


def test_marked_blocks_follow_a_template_that_drops_earlier_reasoning(tmp_path):
    """Qwen3 shows an assistant turn's reasoning only after the last user turn: the earlier
    turn renders without it in the whole conversation, and with it when it ends the
    conversation, so prefixes of the conversation do not line up; the marked blocks do."""
    chat = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello you", "reasoning_content": "hi back"},
        {"role": "user", "content": "why blue?"},
        {"role": "assistant", "content": "because", "reasoning_content": "think sky"},
    ]
    tok = word_tokenizer(QWEN3_MARKED, tmp_path)
    ex = Encoder(tok).encode({"messages": chat}, "chat", "f:1")
    assert trained_runs(tok, ex) == [
        ["hello", " ", "you", "<|im_end|>"],
        ["<think>", "\n", "think", " ", "sky", "\n", "</think>", "\n\n", "because", "<|im_end|>"],
    ]
    # reasoning as context only: the last turn's answer is trained, its reasoning is not
    ex = Encoder(tok, train_on_reasoning=False).encode({"messages": chat}, "chat", "f:1")
    runs = trained_runs(tok, ex)
    assert runs[0] == ["hello", " ", "you", "<|im_end|>"]
    assert "sky" not in runs[-1] and runs[-1][-2:] == ["because", "<|im_end|>"]


def test_marked_blocks_train_only_from_the_first_trained_turn(tmp_path):
    """A conversational prompt-completion row trains its completion's turns only, marked or not."""
    tok = word_tokenizer(QWEN_MARKED, tmp_path)
    ex = Encoder(tok).encode({"prompt": CHAT[:3], "completion": CHAT[3:]}, "completion", "f:1")
    assert trained_runs(tok, ex) == [["bye", "<|im_end|>"]]
    # mask_prompt false trains every token after the first, whatever the markings
    ex = Encoder(tok, mask_prompt=False).encode({"messages": CHAT}, "chat", "f:1")
    assert ex.mask == [0] + [1] * (len(ex.ids) - 1)


@pytest.mark.real
def test_smollm2s_own_tokenizer_and_template(tmp_path):
    """The template above is SmolLM2's own, and its real tokenizer trains the same words."""
    from conftest import smollm2_gguf
    from mlxtune.gguf.tokenizer import write_tokenizer_from_gguf

    write_tokenizer_from_gguf(smollm2_gguf(), tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert tok._tokenizer.chat_template == SMOLLM2
    ex = Encoder(tok).encode({"messages": CHAT}, "chat", "f:1")
    runs = [tok._tokenizer.decode(run) for run in _id_runs(ex)]
    assert runs == ["hello you<|im_end|>\n", "bye<|im_end|>\n"]


def _id_runs(ex):
    runs, run = [], []
    for t, m in zip(ex.ids, ex.mask, strict=True):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])
