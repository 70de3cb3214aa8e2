"""Tokenizers read from a GGUF file's metadata (mlxtune.gguf.tokenizer).

The expected ids come from the tokenizer a GGUF was written from (mlxtune's own export read back:
the trained tokenizer, or sentencepiece itself for sentencepiece models), or from transformers'
own GGUF reader for a real model's file."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import sentencepiece as spm

from conftest import smollm2_gguf, tiny_arch
from mlxtune.errors import UserInputError
from mlxtune.export.gguf.write import write_gguf_model
from mlxtune.gguf.tokenizer import BPE_PRE, write_tokenizer_from_gguf
from mlxtune.models import build_model
from mlxtune.tokenizer import load_tokenizer

CORPUS = [
    "reverse hello = olleh",
    "The quick brown fox jumps over the lazy dog.",
    "ünïcödé émigré — naïve café 日本語 🤗",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew lines\n\n\n  indented",
    "digits 12345 and 3.14159, 1,000,000",
    "It's they'll've I'M don't",
    "ｆｕｌｌｗｉｄｔｈ ①② ﬁ",
    "",
]
TRAIN = [
    "reverse hello = olleh",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and 2024!",
    "ünïcödé émigré naïve café",
    "  indented\n\tcode()  # done",
    "It's they'll I'm",
] * 30
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Reverse  hello, please: 123"},
    {"role": "assistant", "content": "olleh ünï"},
    {"role": "user", "content": "again"},
]


def export(tmp_path: Path, tokenizer, tokenizer_dir: Path, vocab_size: int) -> Path:
    """A tiny llama model with this tokenizer, written by mlxtune's GGUF export."""
    model, cfg = build_model(tiny_arch("llama"), vocab_size)
    out = tmp_path / "gguf"
    out.mkdir()
    return write_gguf_model(model, cfg, tokenizer, tokenizer_dir, out, "f32")


def read_back(gguf_path: Path, tmp_path: Path):
    info = write_tokenizer_from_gguf(gguf_path, tmp_path / "back")
    return info, load_tokenizer(tmp_path / "back")


def byte_level_bpe(path: Path, style: str) -> Path:
    """A byte-level BPE tokenizer trained here: ChatML special tokens, a non-special added token
    (<think>), a chat template, and GPT-2, Qwen2 or Llama 3 pre-tokenization. The Llama 3 one, as
    Llama 3's own, adds BOS and takes a word that is a token as a whole (ignore_merges; " zzz"
    is such a token, which no merge reaches)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style == "gpt-2")
    if style != "gpt-2":  # the split patterns the models' tokenizer.json files have
        split = pre_tokenizers.Split(Regex(BPE_PRE[style].splits[0]), behavior="isolated")
        level = pre_tokenizers.Sequence([split, level])
    tk.pre_tokenizer = level
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(TRAIN, trainer)
    extra = {}
    if style == "llama-bpe":
        spec = json.loads(tk.to_str())
        spec["model"]["ignore_merges"] = True
        spec["model"]["vocab"]["Ġzzz"] = len(spec["model"]["vocab"])
        tk = Tokenizer.from_str(json.dumps(spec))
        tk.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A",
            pair="<|endoftext|> $A <|endoftext|> $B:1",
            special_tokens=[("<|endoftext|>", 0)],
        )
        extra["bos_token"] = "<|endoftext|>"
    tk.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", **extra)
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("style", ["gpt-2", "qwen2", "llama-bpe"])
def test_byte_level_bpe_reads_back_with_the_original_ids(tmp_path, style):
    tok_dir = byte_level_bpe(tmp_path / "tok", style)
    original = load_tokenizer(tok_dir)
    info, back = read_back(export(tmp_path, original, tok_dir, len(original)), tmp_path)

    texts = CORPUS + [
        "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
        "a<think>b <think> c",
        "say zzz and zzzz",
    ]
    for text in texts:
        ids = original.encode(text)
        assert back.encode(text) == ids, text
        bos = "<|endoftext|>" if style == "llama-bpe" else ""
        assert back.decode(ids) == original.decode(ids) == bos + text
    assert back.apply_chat_template(CONVERSATION) == original.apply_chat_template(CONVERSATION)
    assert back.chat_template == CHATML
    if style == "llama-bpe":
        zzz = original._tokenizer.convert_tokens_to_ids("Ġzzz")
        assert zzz in original.encode("say zzz") and original.encode("x")[0] == 0
    assert info == {
        "model": "gpt2",
        "pre": style,
        "vocab_size": len(original),
        "bos_token_id": original.bos_token_id,
        "eos_token_id": original.eos_token_id,
        "unk_token_id": None,
        "pad_token_id": None,
        "add_bos_token": style == "llama-bpe",
        "add_eos_token": False,
        "chat_template": True,
    }


def sentencepiece_ids(sp, text: str, specials: list[str], bos: bool = True) -> list[int]:
    """sentencepiece's ids, with special tokens in the text taken whole (as transformers and
    llama.cpp take them) and each stretch of text between them encoded on its own."""
    ids = [sp.bos_id()] if bos else []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


def test_unigram_sentencepiece_reads_back_with_sentencepiece_ids(
    tmp_path, tokenizer, tokenizer_dir
):
    """mlxtune's trained unigram tokenizer, exported as llama.cpp's "t5" model (Viterbi, with the
    normaliser's character map), reads back with sentencepiece's own ids."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    info, back = read_back(export(tmp_path, tokenizer, tokenizer_dir, len(tokenizer)), tmp_path)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    template = back.apply_chat_template(CONVERSATION, tokenize=False)
    assert template == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    for text in CORPUS + ["hello</s>there<s> again <pad>", template]:
        assert back.encode(text) == sentencepiece_ids(sp, text, specials), text
    assert back.apply_chat_template(CONVERSATION) == sentencepiece_ids(
        sp, template, specials, False
    )
    # where mlxtune's own tokenizer.json agrees with sentencepiece (it has no tabs or newlines)
    for text in ["reverse hello = olleh", "  the quick   brown fox ", "ünïcödé ①", "</s>x"]:
        assert back.encode(text) == tokenizer.encode(text), text
    for text in ["reverse hello = olleh", "  the   quick brown fox  "]:
        ids = back.encode(text)
        assert back.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:])
    assert info == {
        "model": "t5",
        "pre": None,
        "vocab_size": sp.get_piece_size(),
        "bos_token_id": sp.bos_id(),
        "eos_token_id": sp.eos_id(),
        "unk_token_id": sp.unk_id(),
        "pad_token_id": sp.pad_id(),
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": True,
    }


def test_sentencepiece_bpe_reads_back_with_sentencepiece_ids(tmp_path):
    """A Llama 2 style sentencepiece BPE model (byte fallback, no normaliser), exported as
    llama.cpp's "llama" model, reads back with sentencepiece's own ids."""
    tok_dir = tmp_path / "spm"
    tok_dir.mkdir()
    (tmp_path / "train.txt").write_text("\n".join(TRAIN))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "train.txt"),
        model_prefix=str(tok_dir / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
        "{{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    )
    holder = SimpleNamespace(_tokenizer=SimpleNamespace(chat_template=template))
    info, back = read_back(export(tmp_path, holder, tok_dir, sp.get_piece_size()), tmp_path)
    specials = ["<unk>", "<s>", "</s>"]
    chat = back.apply_chat_template(CONVERSATION, tokenize=False)
    for text in CORPUS + ["hello</s>world<s> again", chat]:
        ids = back.encode(text)
        assert ids == sentencepiece_ids(sp, text, specials), text
        if "<" not in text:
            assert back.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]) == text
    assert any(sp.id_to_piece(i).startswith("<0x") for i in back.encode("日本語 🤗"))
    assert back.apply_chat_template(CONVERSATION) == sentencepiece_ids(sp, chat, specials, False)
    assert info["model"] == "llama" and info["vocab_size"] == sp.get_piece_size()
    assert (info["bos_token_id"], info["eos_token_id"], info["unk_token_id"]) == (
        sp.bos_id(),
        sp.eos_id(),
        sp.unk_id(),
    )


def test_a_char_sentencepiece_model_reads_back_on_its_alphabet(tmp_path):
    """The quickstart's char model is exported as llama.cpp's "llama" model, which applies no
    normaliser: on text its normaliser leaves alone, sentencepiece's ids."""
    from conftest import REPO

    base = REPO / "recipes" / "models" / "reverse-tiny"
    sp = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    tok = load_tokenizer(base)
    _, back = read_back(export(tmp_path, tok, base, len(tok)), tmp_path)
    for text in ["reverse hello = olleh", "reverse abcxyz = zyxcba"]:
        assert back.encode(text) == [sp.bos_id(), *sp.encode(text)], text


def smollm2() -> Path:
    return smollm2_gguf("torch")


@pytest.mark.real
def test_smollm2_gguf_tokenizer_matches_transformers(tmp_path):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    path = smollm2()
    info, back = read_back(path, tmp_path)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = CORPUS + [
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "x = f(a, b) ** 2  # comment\n    return [i for i in range(10)]",
        "<|endoftext|><repo_name>mlxtune<file_sep>",
    ]
    circled = "ｆｕｌｌｗｉｄｔｈ ①② ﬁ"  # numerals other than 0-9: see below
    for text in texts:
        if text != circled:
            assert back.encode(text) == ref.encode(text), text
        assert back.decode(back.encode(text)) == text
    want = ref.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    assert back.apply_chat_template(CONVERSATION, add_generation_prompt=True) == want
    assert back.chat_template == ref.chat_template and "<|im_start|>" in back.chat_template
    assert (back.bos_token, back.eos_token, back.unk_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.unk_token,
    )
    assert info["model"] == "gpt2" and info["pre"] == "smollm"
    assert info["vocab_size"] == len(ref) == 49152 and info["chat_template"]
    # transformers' GGUF reader splits "smollm" text by GPT-2's pattern alone; SmolLM2's own
    # tokenizer.json (and llama.cpp) first cut every numeral off on its own. The vocabulary has no
    # token of a space and a digit 0-9, so that shows only on other numerals (①). With SmolLM2's
    # own pre-tokenizer put back, every text agrees.
    assert back.encode(circled) != ref.encode(circled)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in texts:
        assert back.encode(text) == ref.encode(text), text


def tiny_gguf(path: Path, model: str, pre: str | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_tokenizer_models_and_pre_tokenizers_are_refused(tmp_path):
    bert = tiny_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(UserInputError, match="tokenizer model 'bert'") as e:
        write_tokenizer_from_gguf(bert, tmp_path / "out")
    assert e.value.where == str(bert)
    odd = tiny_gguf(tmp_path / "odd.gguf", "gpt2", "deepseek-llm")
    with pytest.raises(UserInputError, match="pre-tokenizer 'deepseek-llm'") as e:
        write_tokenizer_from_gguf(odd, tmp_path / "out")
    assert e.value.where == str(odd)
    (tmp_path / "not.gguf").write_text("not a gguf")
    with pytest.raises(UserInputError, match="not a readable GGUF"):
        write_tokenizer_from_gguf(tmp_path / "not.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a supported pair writes a folder
    ok = write_tokenizer_from_gguf(tiny_gguf(tmp_path / "ok.gguf", "gpt2", "qwen2"), tmp_path / "o")
    assert ok["vocab_size"] == 3 and load_tokenizer(tmp_path / "o").encode("ab") == [2]
