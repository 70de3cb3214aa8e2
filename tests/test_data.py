import json

import numpy as np
import pytest

from conftest import load_minimal, reverse_rows, write_jsonl
from mlxtune.data import (
    DataFormat,
    Encoder,
    PromptAnswer,
    batch_order,
    detect_format,
    eval_batches,
    field,
    format_names,
    load_split,
    make_batch,
    register_format,
    split_off,
    unregister_format,
)
from mlxtune.errors import UserInputError


def test_detect_format_from_keys():
    assert detect_format({"text": "x"}, "f") == "text"
    assert detect_format({"prompt": "a", "completion": "b"}, "f") == "completion"
    assert detect_format({"instruction": "a", "input": "", "output": "b"}, "f") == "instruction"
    assert detect_format({"messages": []}, "f") == "chat"
    assert detect_format({"input_ids": [1, 2]}, "f") == "tokens"
    with pytest.raises(UserInputError, match="cannot tell the format"):
        detect_format({"foo": 1}, "f:3")


def test_completion_mask_covers_exactly_the_answer_and_eos(tokenizer):
    enc = Encoder(tokenizer)
    ex = enc.encode({"prompt": "reverse abc =", "completion": " cba"}, "completion", "f:1")
    prompt_ids = list(tokenizer.encode("reverse abc ="))
    full = list(tokenizer.encode("reverse abc = cba"))
    assert ex.ids == full + [tokenizer.eos_token_id]
    start = next(i for i, (a, b) in enumerate(zip(prompt_ids + [-1], full, strict=False)) if a != b)
    assert ex.mask == [0] * start + [1] * (len(ex.ids) - start)
    assert (
        tokenizer.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if m][:-1]).strip()
        == "cba"
    )
    assert ex.prompt == "reverse abc =" and ex.answer == " cba"


def test_unmasked_prompt_trains_on_every_token_after_the_first(tokenizer):
    ex = Encoder(tokenizer, mask_prompt=False).encode(
        {"prompt": "abc", "completion": " d"}, "completion", "f"
    )
    assert ex.mask == [0] + [1] * (len(ex.ids) - 1)


def test_text_and_instruction_formats(tokenizer):
    enc = Encoder(tokenizer, add_eos=False)
    ex = enc.encode({"text": "hello there"}, "text", "f")
    assert ex.ids == list(tokenizer.encode("hello there")) and ex.mask[0] == 0 and all(ex.mask[1:])
    ins = enc.encode(
        {"instruction": "say hi", "input": "to bob", "output": "hi bob"}, "instruction", "f"
    )
    assert "### Input:\nto bob" in ins.prompt and ins.answer == "hi bob"
    n = ins.n_targets
    assert 0 < n < len(ins.ids) - 1


def test_tokens_format_with_and_without_mask(tokenizer):
    enc = Encoder(tokenizer)
    ex = enc.encode({"input_ids": [5, 6, 7, 8], "mask": [0, 0, 1, 1]}, "tokens", "f")
    assert ex.ids == [5, 6, 7, 8] and ex.mask == [0, 0, 1, 1]
    with pytest.raises(UserInputError, match="outside the vocabulary"):
        enc.encode({"input_ids": [5, 10**6]}, "tokens", "f:2")
    with pytest.raises(UserInputError, match="mask"):
        enc.encode({"input_ids": [5, 6], "mask": [1]}, "tokens", "f:2")


def test_chat_trains_on_every_assistant_turn_only(tokenizer):
    enc = Encoder(tokenizer)
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "good bye"},
    ]
    ex = enc.encode({"messages": msgs}, "chat", "f:1")
    tmpl = tokenizer._tokenizer
    full = list(tmpl.apply_chat_template(msgs, tokenize=True, return_dict=False))
    assert ex.ids == full
    trained = [t for t, m in zip(ex.ids, ex.mask, strict=True) if m]
    text = tokenizer.decode(trained)
    assert "hi there" in text and "good bye" in text
    assert "hello" not in text and "bye" not in text.replace("good bye", "")
    # Two separate spans: the user turn between them is not trained on.
    spans = sum(1 for i in range(1, len(ex.mask)) if ex.mask[i] and not ex.mask[i - 1])
    assert spans == 2
    assert ex.answer == "good bye" and ex.prompt.endswith("assistant: ")


def test_chat_without_assistant_turn_is_refused(tokenizer):
    with pytest.raises(UserInputError, match="no assistant turn"):
        Encoder(tokenizer).encode({"messages": [{"role": "user", "content": "x"}]}, "chat", "f:4")


@pytest.mark.parametrize("role", ["usr", "Assistant"])
def test_a_message_with_an_unknown_role_is_refused_by_its_index(tokenizer, role):
    """A misspelt role would be printed as written by the chat template (and 'Assistant' never
    trained on): chat rows and GRPO's prompt messages refuse it, naming the message."""
    from mlxtune.data.prompts import PromptEncoder

    msgs = [{"role": "user", "content": "x"}, {"role": role, "content": "y"}]
    expected = rf"unknown role '{role}'; expected system, user, assistant"
    with pytest.raises(UserInputError, match=expected) as e:
        Encoder(tokenizer).encode(
            {"messages": [*msgs, {"role": "assistant", "content": "z"}]}, "chat", "f:4"
        )
    assert e.value.where == "f:4 (messages[1])"
    with pytest.raises(UserInputError, match=expected) as e:
        PromptEncoder(tokenizer).prompt(msgs, "p:2")
    assert e.value.where == "p:2 (messages[1])"


def test_max_length_truncate_and_drop_are_counted(tmp_path, tokenizer):
    rows = [{"text": "a b c d e f g h i j k l m n o p"}, {"text": "a b"}, {"text": "a"}]
    p = write_jsonl(tmp_path / "t.jsonl", rows)
    enc = Encoder(tokenizer)
    short = len(enc.encode({"text": "a b"}, "text", "f").ids)
    assert short < 8
    ds = load_split(p, enc, "auto", max_length=8, overlong="truncate", min_length=short + 1)
    assert ds.stats.truncated == 1 and all(len(e.ids) <= 8 for e in ds.examples)
    assert ds.stats.dropped_too_short == 2 and ds.stats.kept == 1
    ds = load_split(p, enc, "auto", max_length=8, overlong="drop", min_length=1)
    assert ds.stats.dropped_too_long == 1 and ds.stats.kept == 2
    assert "1 dropped too long" in ds.stats.line()


def test_every_example_too_long_is_a_clear_error(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c d e f g h"}] * 3)
    with pytest.raises(UserInputError, match="no example is left"):
        load_split(p, Encoder(tokenizer), "auto", max_length=3, overlong="drop", min_length=1)


@pytest.mark.parametrize(
    "content, message, line",
    [
        (b'{"text": "a"}\n{"text": \n', "not valid JSON", 2),
        (b'{"text": "a"}\n\n[1, 2]\n', "must be a JSON object", 3),
        (b'{"text": "a"}\n{"text": "\xff\xfe"}\n', "not UTF-8", 2),
        (b'{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n', "missing field 'completion'", 2),
        (b'{"prompt": "a", "completion": 3}\n', "must be a str", 1),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, tokenizer, content, message, line):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(content)
    with pytest.raises(UserInputError) as e:
        load_split(p, Encoder(tokenizer), "auto", 64, "truncate", 1)
    assert message in str(e.value)
    assert f"{p}:{line}" in str(e.value)


def test_empty_and_missing_files(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserInputError, match="no examples"):
        load_split(tmp_path / "empty.jsonl", Encoder(tokenizer), "auto", 64, "truncate", 1)
    with pytest.raises(UserInputError, match="not found"):
        load_split(tmp_path / "nope.jsonl", Encoder(tokenizer), "auto", 64, "truncate", 1)


def test_validation_split_is_deterministic_and_disjoint(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "t.jsonl", reverse_rows(50))
    ds = load_split(p, Encoder(tokenizer), "auto", 64, "truncate", 1)
    tr, va = split_off(ds, 0.1, seed=0)
    tr2, va2 = split_off(ds, 0.1, seed=0)
    assert len(va) == 5 and len(tr) == 45
    assert [e.ids for e in va.examples] == [e.ids for e in va2.examples]
    # together they are the whole set, each example once: disjoint
    both = sorted(e.ids for d in (tr, va) for e in d.examples)
    assert both == sorted(e.ids for e in ds.examples)


def test_batches_pad_right_and_mask_padding():
    from mlxtune.data import Example

    exs = [Example([1, 5, 6, 2], [0, 0, 1, 1]), Example([1, 7, 2], [0, 1, 1])]
    b = make_batch(exs, pad_id=3, multiple=8)
    assert b.tokens.shape == (2, 9)  # 3 positions read, rounded up to 8, plus 1
    assert (b.tokens[1, 3:] == 3).all() and (b.mask[1, 3:] == 0).all()
    assert b.n_targets == 2 + 2


def test_epoch_order_is_seeded_and_reshuffled_every_epoch():
    lengths = list(range(100))
    e0 = batch_order(lengths, 4, epoch=0, seed=1, bucket_size=4)
    e0b = batch_order(lengths, 4, epoch=0, seed=1, bucket_size=4)
    e1 = batch_order(lengths, 4, epoch=1, seed=1, bucket_size=4)
    assert e0 == e0b and e0 != e1
    assert sorted(i for b in e0 for i in b) == lengths  # every example once


def test_length_buckets_reduce_padding():
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(5, 200, size=512))

    def padding(batches):
        return sum(
            max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches
        )

    bucketed = padding(batch_order(lengths, 8, 0, 0, bucket_size=16))
    plain = padding(batch_order(lengths, 8, 0, 0, bucket_size=1))
    assert bucketed < 0.3 * plain


def test_eval_batches_cover_the_split_once(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "t.jsonl", reverse_rows(21))
    ds = load_split(p, Encoder(tokenizer), "auto", 64, "truncate", 1)
    bs = eval_batches(ds, 4, 0, 8)
    assert sum(len(b.tokens) for b in bs) == 21
    assert sum(b.n_targets for b in bs) == ds.stats.target_tokens


def test_generation_prompts_are_the_tokens_training_reads(tokenizer):
    enc = Encoder(tokenizer)
    comp = enc.encode({"prompt": "reverse abc =", "completion": " cba"}, "completion", "f")
    chat = enc.encode(
        {
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
            ]
        },
        "chat",
        "f",
    )
    for ex in (comp, chat):
        n = len(ex.prompt_ids)
        assert ex.ids[:n] == ex.prompt_ids and ex.mask[n - 1] == 0 and ex.mask[n] == 1


def test_token_ids_of_added_special_tokens_are_accepted(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    tok._tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    new_id = tok._tokenizer.convert_tokens_to_ids("<|end|>")
    ex = Encoder(tok).encode({"input_ids": [1, 5, new_id]}, "tokens", "f")
    assert ex.ids[-1] == new_id


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"input_ids": [1, 2, 3], "mask": 7}, "'mask' must be 0/1 values"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            None,
        ),
    ],
)
def test_odd_examples_give_clear_errors_or_work(tokenizer, obj, message):
    enc = Encoder(tokenizer)
    fmt = "tokens" if "input_ids" in obj else "chat"
    if message:
        with pytest.raises(UserInputError, match=message):
            enc.encode(obj, fmt, "f:9")
    else:
        assert enc.encode(obj, fmt, "f:9").n_targets > 0


def test_a_chat_template_that_refuses_names_the_line(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(
        tokenizer_dir,
        chat_template="{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    msgs = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    with pytest.raises(
        UserInputError, match="f:3: the chat template refused this conversation.*alternate"
    ):
        Encoder(tok).encode({"messages": msgs}, "chat", "f:3")


def test_limited_evaluation_uses_a_fixed_sample_not_the_shortest(tmp_path, tokenizer):
    p = write_jsonl(tmp_path / "t.jsonl", reverse_rows(64))
    ds = load_split(p, Encoder(tokenizer), "auto", 64, "truncate", 1)
    picked = eval_batches(ds, 4, 0, 8, max_batches=2)
    again = eval_batches(ds, 4, 0, 8, max_batches=2)
    assert [b.tokens.tolist() for b in picked] == [b.tokens.tolist() for b in again]
    shortest = sorted(len(e.ids) for e in ds.examples)[:8]
    lengths = sorted(int((b.tokens != 0).sum(axis=1).max()) for b in picked)
    assert sum(b.n_targets for b in picked) > 0
    assert len({len(e.ids) for e in ds.examples}) > 1  # else any sample is "the shortest"
    assert max(lengths) > max(shortest)


def test_held_out_split_keeps_the_files_counts(tmp_path, tokenizer):
    rows = reverse_rows(20) + [{"prompt": "reverse " + "a" * 80 + " =", "completion": " x"}]
    p = write_jsonl(tmp_path / "t.jsonl", rows)
    ds = load_split(p, Encoder(tokenizer), "auto", 32, "drop", 1)
    tr, va = split_off(ds, 0.2, seed=0)
    assert tr.stats.dropped_too_long == 1 and "1 dropped too long" in tr.stats.line()


BUILT_IN_FORMATS = (
    "text",
    "completion",
    "instruction",
    "chat",
    "sharegpt",
    "tokens",
    "preference",
    "unpaired",
)


@pytest.fixture
def qa_format():
    """A "qa" format for {"question", "answer"} rows, registered for one test only."""
    fmt = register_format(
        DataFormat(
            "qa",
            keys=("question", "answer"),
            pieces=lambda row, where: PromptAnswer(
                f"question: {field(row, 'question', where)} answer:",
                " " + field(row, "answer", where),
            ),
        )
    )
    yield fmt
    unregister_format("qa")
    assert format_names() == BUILT_IN_FORMATS


def test_a_registered_format_is_detected_and_encoded_from_its_pieces(
    tmp_path, tokenizer, qa_format
):
    rows = [
        {"question": "reverse abc", "answer": "cba"},
        {"question": "what is dog", "answer": "god"},
        {"question": "the quick fox", "answer": "the lazy dog"},
    ]
    p = write_jsonl(tmp_path / "qa.jsonl", rows)
    eos = tokenizer.eos_token_id
    for train_on_eos in (True, False):
        ds = load_split(p, Encoder(tokenizer, train_on_eos=train_on_eos), "auto", 64, "drop", 1)
        assert len(ds) == len(rows)
        for row, ex in zip(rows, ds.examples, strict=True):
            prompt = f"question: {row['question']} answer:"
            prompt_ids = list(tokenizer.encode(prompt))
            full = list(tokenizer.encode(prompt + " " + row["answer"]))
            # The prompt is masked as far as its own tokens match the full text's.
            start = 0
            while start < len(prompt_ids) and prompt_ids[start] == full[start]:
                start += 1
            assert 1 < start < len(full)
            assert ex.ids == full + [eos]
            assert ex.mask == [0] * start + [1] * (len(full) - start) + [int(train_on_eos)]
            answer_ids = [t for t, m in zip(ex.ids[:-1], ex.mask[:-1], strict=True) if m]
            assert tokenizer.decode(answer_ids).strip() == row["answer"]
            assert ex.prompt == prompt and ex.answer == " " + row["answer"]
            assert ex.prompt_ids == full[:start]
    # Named explicitly, and tried before the built-in formats when a row has its keys.
    named = load_split(p, Encoder(tokenizer), "qa", 64, "drop", 1)
    assert [e.ids for e in named.examples] == [e.ids for e in ds.examples]
    assert detect_format({"question": "a", "answer": "b", "text": "c"}, "f") == "qa"
    assert detect_format({"text": "c"}, "f") == "text"


def test_a_registered_formats_bad_row_names_file_and_line(tmp_path, tokenizer, qa_format):
    p = tmp_path / "qa.jsonl"
    p.write_text('{"question": "a", "answer": "b"}\n\n{"question": "a"}\n')
    with pytest.raises(UserInputError) as e:
        load_split(p, Encoder(tokenizer), "auto", 64, "drop", 1)
    assert f"{p}:3" in str(e.value) and "missing field 'answer'" in str(e.value)


def test_registration_can_be_undone_and_names_are_unique(tokenizer, qa_format):
    assert format_names() == (*BUILT_IN_FORMATS, "qa")
    with pytest.raises(ValueError, match="already registered"):
        register_format(qa_format)
    with pytest.raises(ValueError, match="not a format name"):
        register_format(DataFormat("auto", ("x",), qa_format.pieces))
    assert unregister_format("qa") is qa_format
    with pytest.raises(UserInputError, match="cannot tell the format"):
        detect_format({"question": "a", "answer": "b"}, "f:1")
    with pytest.raises(ValueError, match="unknown data format 'qa'.*text, completion"):
        Encoder(tokenizer).encode({"question": "a", "answer": "b"}, "qa", "f:1")
    register_format(qa_format)  # back for the fixture to remove


def test_a_row_of_no_known_format_names_file_line_and_the_formats(tmp_path, tokenizer, qa_format):
    p = tmp_path / "odd.jsonl"
    p.write_text('\n{"foo": 1, "bar": 2}\n')
    with pytest.raises(UserInputError) as e:
        load_split(p, Encoder(tokenizer), "auto", 64, "drop", 1)
    assert str(e.value).endswith(
        f"{p}:2: cannot tell the format from keys ['bar', 'foo']: expected text, "
        "prompt+completion, instruction+output, messages, conversations, input_ids, "
        "chosen+rejected, prompt+completion+label, or question+answer"
    )
    # Without it, the built-in formats alone, as before.
    unregister_format("qa")
    try:
        with pytest.raises(UserInputError) as e:
            load_split(p, Encoder(tokenizer), "auto", 64, "drop", 1)
    finally:
        register_format(qa_format)
    assert str(e.value).endswith(
        f"{p}:2: cannot tell the format from keys ['bar', 'foo']: expected text, "
        "prompt+completion, instruction+output, messages, conversations, input_ids, "
        "chosen+rejected, or prompt+completion+label"
    )


def test_a_recipe_names_a_registered_format_and_is_refused_an_unknown_one(tmp_path, qa_format):
    r = load_minimal(tmp_path, ["data.format=qa"])
    assert r.data.format == "qa"
    with pytest.raises(UserInputError, match="unknown format 'nope'; known: auto, text") as e:
        load_minimal(tmp_path, ["data.format=nope"])
    assert "qa" in str(e.value) and "data.format" in str(e.value)


# ------------------------------------------------------------------ data people already have
def test_sharegpt_is_chat_with_its_speakers_as_roles(tmp_path, tokenizer):
    conv = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "hi there"},
    ]
    p = write_jsonl(tmp_path / "s.jsonl", [{"conversations": conv}])
    assert detect_format({"conversations": conv}, "f") == "sharegpt"
    ds = load_split(p, Encoder(tokenizer), "auto", 256, "truncate", 1)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
    ]
    want = Encoder(tokenizer).encode({"messages": msgs}, "chat", "f:1")
    assert ds.examples[0].ids == want.ids and ds.examples[0].mask == want.mask
    bad = write_jsonl(tmp_path / "b.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])
    with pytest.raises(UserInputError, match=r"unknown speaker 'bot'") as e:
        load_split(bad, Encoder(tokenizer), "auto", 256, "truncate", 1)
    assert f"{bad}:1 (conversations[0])" in str(e.value)


def test_csv_tsv_and_text_files_with_columns_mapped(tmp_path, tokenizer):
    enc = Encoder(tokenizer)
    want = [enc.encode({"prompt": q, "completion": a}, "completion", "f") for q, a in
            [("reverse ab =", " ba"), ('say "hi", twice =', " hi hi")]]  # fmt: skip
    (tmp_path / "t.csv").write_text(
        'question,answer,source\nreverse ab =, ba,x\n"say ""hi"", twice =", hi hi,y\n'
    )
    (tmp_path / "t.tsv").write_text(
        'question\tanswer\nreverse ab =\t ba\nsay "hi", twice =\t hi hi\n'
    )
    for name in ("t.csv", "t.tsv"):
        ds = load_split(
            tmp_path / name, enc, "auto", 64, "truncate", 1,
            columns={"prompt": "question", "completion": "answer"},
        )  # fmt: skip
        assert [e.ids for e in ds.examples] == [e.ids for e in want], name
        assert [e.mask for e in ds.examples] == [e.mask for e in want], name
    with pytest.raises(UserInputError, match="no column 'query'") as e:
        load_split(tmp_path / "t.csv", enc, "auto", 64, "truncate", 1, columns={"prompt": "query"})
    assert f"{tmp_path / 't.csv'}:2" in str(e.value)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n3,4,5\n")
    with pytest.raises(UserInputError, match="3 cells, the header names 2") as e:
        load_split(tmp_path / "bad.csv", enc, "text", 64, "truncate", 1)
    assert f"{tmp_path / 'bad.csv'}:3" in str(e.value)
    for name, text in (("bom.csv", "question,answer\nreverse ab =, ba\n"), ("bom.jsonl", None)):
        row = json.dumps({"question": "reverse ab =", "answer": " ba"}) + "\n"
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + (text or row).encode())  # Excel's BOM
        ds = load_split(
            tmp_path / name, enc, "auto", 64, "truncate", 1,
            columns={"prompt": "question", "completion": "answer"},
        )  # fmt: skip
        assert [e.ids for e in ds.examples] == [want[0].ids], name
    (tmp_path / "twice.csv").write_text("prompt,prompt,completion\nkept?,or this?, a\n")
    with pytest.raises(UserInputError, match="the header names the column 'prompt' twice") as e:
        load_split(tmp_path / "twice.csv", enc, "auto", 64, "truncate", 1)
    assert f"{tmp_path / 'twice.csv'}:1" in str(e.value)
    # plain text: each paragraph an example, every token trained on
    (tmp_path / "t.txt").write_text("first line\nof one\n\n\nsecond one\n")
    ds = load_split(tmp_path / "t.txt", enc, "auto", 64, "truncate", 1)
    texts = ["first line\nof one", "second one"]
    assert [e.ids for e in ds.examples] == [enc.encode({"text": t}, "text", "f").ids for t in texts]


def test_json_arrays_are_read_as_rows_by_line_and_binary_tables_refused(tmp_path, tokenizer):
    from mlxtune.data import BadRows

    enc = Encoder(tokenizer)
    rows = [
        {"instruction": "reverse", "input": "ab", "output": "ba"},
        {"instruction": "copy", "input": "cd", "output": "cd"},
        {"instruction": "reverse", "input": "xyz", "output": "zyx"},
    ]
    write_jsonl(tmp_path / "lines.jsonl", rows)
    want = load_split(tmp_path / "lines.jsonl", enc, "auto", 64, "truncate", 1)
    # Alpaca's alpaca_data.json: an indented array; and a .json file of lines (JSONL)
    (tmp_path / "alpaca.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "lines.json").write_text((tmp_path / "lines.jsonl").read_text())
    for name in ("alpaca.json", "lines.json"):
        ds = load_split(tmp_path / name, enc, "auto", 64, "truncate", 1)
        assert [e.ids for e in ds.examples] == [e.ids for e in want.examples], name
        assert [e.mask for e in ds.examples] == [e.mask for e in want.examples], name
    # an item that is not an object is named by the line it starts on (the 3rd item: line 12)
    bad = [rows[0], rows[1], "just text", rows[2]]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad, indent=2))
    assert p.read_text().splitlines()[11].strip() == '"just text",'
    with pytest.raises(UserInputError, match="must be a JSON object, got str") as e:
        load_split(p, enc, "auto", 64, "truncate", 1)
    assert f"{p}:12" in str(e.value)
    ds = load_split(p, enc, "auto", 64, "truncate", 1, bad=BadRows(True, 0.5))
    assert ds.stats.kept == 3 and ds.stats.skipped == 1
    p.write_text('[\n  {"output": "a"},\n  {"output": "b"\n]\n')
    with pytest.raises(UserInputError, match="not valid JSON") as e:
        load_split(p, enc, "auto", 64, "truncate", 1)
    assert f"{p}:4" in str(e.value)
    (tmp_path / "t.xlsx").write_bytes(b"PK\x03\x04")
    with pytest.raises(UserInputError, match=r"\.xlsx files are not read; write the rows as"):
        load_split(tmp_path / "t.xlsx", enc, "auto", 64, "truncate", 1)


def test_bad_rows_are_skipped_counted_and_named_up_to_a_share(tmp_path, tokenizer):
    from mlxtune.data import BadRows

    good = [{"prompt": f"p{i} =", "completion": " x"} for i in range(40)]
    lines = [json.dumps(r) for r in good]
    lines[3] = '{"prompt": "a" '  # not JSON
    lines[10] = '{"prompt": "a"}'  # no completion
    lines[20] = '{"prompt": "a", "completion": 5}'  # not a string
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    enc = Encoder(tokenizer)
    with pytest.raises(UserInputError, match="not valid JSON") as e:  # error: the default
        load_split(p, enc, "auto", 64, "truncate", 1)
    assert f"{p}:4" in str(e.value)
    ds = load_split(p, enc, "auto", 64, "truncate", 1, bad=BadRows(True, 0.1))
    assert ds.stats.kept == 37 and ds.stats.skipped == 3 and "3 skipped (bad)" in ds.stats.line()
    report = "\n".join(ds.stats.skipped_rows)
    assert "skipped 3 bad rows" in report
    for n, why in (
        (4, "not valid JSON"),
        (11, "missing field 'completion'"),
        (21, "field 'completion' must be a str"),
    ):
        assert f"{p}:{n}: {why}" in report
    # 3 of 40 is more than 5%: an error naming the first
    with pytest.raises(UserInputError, match=r"3 of 40 rows are bad.*d.jsonl:4") as e:
        load_split(p, enc, "auto", 64, "truncate", 1, bad=BadRows(True, 0.05))


def test_chat_rows_over_a_tokenizer_without_a_template_say_what_to_do(tokenizer, monkeypatch):
    """A base model's tokenizer (a GGUF without tokenizer.chat_template, often) has no chat
    template: the message says to write the rows as prompt/completion or text, or to set one."""
    monkeypatch.setattr(tokenizer._tokenizer, "chat_template", None)
    chat = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    with pytest.raises(UserInputError, match="f:1: chat data needs.*prompt/completion or text"):
        Encoder(tokenizer).encode(chat, "chat", "f:1")
