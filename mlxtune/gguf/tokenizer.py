"""A Hugging Face tokenizer folder from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no tokenizer.json: its vocabulary, scores, token types, merges and special token
ids are metadata under llama.cpp's key names. ``write_tokenizer_from_gguf`` rebuilds from them a
``tokenizers.Tokenizer`` that encodes as llama.cpp encodes with that file, and writes it with a
``tokenizer_config.json`` (special tokens, add_bos/add_eos, chat template) that
``mlxtune.tokenizer.load_tokenizer`` loads. The tokenizer models (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE. The merges are ranked as listed; the text is split first by the
  regular expressions llama.cpp uses for ``tokenizer.ggml.pre`` (``BPE_PRE``, which
  mlxtune's GGUF export also names its pre-tokenizers from).
- ``llama``: sentencepiece BPE. Adjacent pieces merge highest score first (a piece's score is the
  priority of every pair of pieces that spells it), characters outside the vocabulary fall back
  to ``<0xXX>`` byte tokens, spaces are ``▁`` and a space is put before each run of text when
  ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default for this model).
- ``t5``: sentencepiece unigram (Viterbi over the scores), after the normaliser's precompiled
  character map and the whitespace rules (``remove_extra_whitespaces``, ``add_space_prefix``).

Token types as llama.cpp reads them: control (3) and unknown (2) tokens are special tokens, matched
whole before anything else; user-defined (4) tokens are matched whole too but are not special.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserInputError
from .file import open_gguf

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # sentencepiece's escaped space

# Split patterns, as the models' own tokenizer.json files spell them (the regex dialect of Hugging
# Face tokenizers). llama.cpp applies the patterns of a pre-tokenizer one after the other, each
# to the pieces the previous one left; text that no pattern matches stays a piece of its own.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PUNCT = r"[\p{P}\$\+<=>\^~\|]+"
_DIGIT = r"\p{N}"
_DIGITS3 = r"[0-9][0-9][0-9]"


@dataclass(frozen=True)
class BpePre:
    """How llama.cpp pre-tokenizes for one ``tokenizer.ggml.pre`` name."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a token as a whole is not cut into merges
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


def _family(names, pre: BpePre) -> dict[str, BpePre]:
    return dict.fromkeys(names.split(), pre)


BPE_PRE: dict[str, BpePre] = {
    # llama.cpp's fallback for files without a pre-tokenizer name
    "default": BpePre((_PUNCT, GPT2_SPLIT, r"\p{N}+", _DIGITS3)),
    **_family(
        "gpt-2 phi-2 mpt olmo jais exaone4 gigachat mellum a.x-4.0 trillion granite-docling",
        BpePre((GPT2_SPLIT,)),
    ),
    **_family(
        "llama-bpe llama3 llama-v3 falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        BpePre((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    ),
    **_family("smaug-bpe dbrx", BpePre((LLAMA3_SPLIT,))),
    **_family(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2 stablelm2 megrez",
        BpePre((QWEN2_SPLIT,)),
    ),
    "qwen35": BpePre((QWEN35_SPLIT,)),
    **_family(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        BpePre((_DIGIT, GPT2_SPLIT)),
    ),
    "falcon": BpePre((_PUNCT, GPT2_SPLIT, _DIGITS3)),
    "tekken": BpePre((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 kanana2 talkie minimax-m2", BpePre((GPT4O_SPLIT,))),
    "seed-coder": BpePre((SEED_CODER_SPLIT,)),
}

# The names mlxtune's GGUF export gives a tokenizer.json whose pre-tokenizer is one Split by
# these patterns followed by a ByteLevel step (a ByteLevel step alone is "gpt-2").
EXPORT_PRE_NAMES = {BPE_PRE[name].splits[0]: name for name in ("qwen2", "llama-bpe")}

MODELS = ("gpt2", "llama", "t5")
# llama.cpp's special token ids for a file that does not name them
_DEFAULT_IDS = {
    "llama": {"bos": 1, "eos": 2, "unk": 0},
    "t5": {"eos": 1, "unk": 2, "pad": 0},
}
_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}


def _read_metadata(path: Path) -> dict:
    """The file's tokenizer.* fields (and its architecture) as Python values."""
    import numpy as np

    if not path.is_file():
        raise UserInputError("GGUF file not found", str(path))
    fields = open_gguf(path).fields
    meta = {}
    for key, value in fields.items():
        if not (key.startswith("tokenizer.") or key == "general.architecture"):
            continue
        if key == "tokenizer.ggml.precompiled_charsmap":  # bytes, stored as an array of u8/i8
            meta[key] = np.asarray(value).view(np.uint8).tobytes()
            continue
        meta[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return meta


def _special_ids(meta: dict, kind: str, n: int) -> dict[str, int | None]:
    ids = {}
    for name, key in _ID_KEYS.items():
        tid = meta.get(key, _DEFAULT_IDS.get(kind, {}).get(name))
        ids[name] = int(tid) if tid is not None and 0 <= int(tid) < n else None
    return ids


def _bpe_model(meta: dict, tokens: list[str], where: str):
    """llama.cpp's "gpt2" model: byte-level BPE with the file's merges and split patterns."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    name = meta.get("tokenizer.ggml.pre") or "default"  # llama.cpp: missing means default
    pre = BPE_PRE.get(name)
    if pre is None:
        raise UserInputError(
            f"the GGUF's BPE pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(sorted(BPE_PRE))}",
            where,
        )
    if "tokenizer.ggml.merges" not in meta:
        raise UserInputError("a gpt2 tokenizer without tokenizer.ggml.merges", where)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for merge in meta["tokenizer.ggml.merges"]:
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    tk = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    return tk, name, pre


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]):
    """Sentencepiece BPE as pairwise merges: every split of a piece into two pieces merges at
    the piece's score, highest first, as llama.cpp merges. (llama.cpp gives equal scores to the
    leftmost pair in the text, which a rank cannot say; here the lower token id goes first.)"""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for i, tok in enumerate(tokens):
        if types[i] == BYTE or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return vocab, [(left, right) for *_, left, right in ranked]


def _spm_model(meta: dict, tokens: list[str], types: list[int], ids: dict):
    """llama.cpp's "llama" model: sentencepiece BPE by score, with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    vocab, merges = _spm_merges(tokens, scores, types)
    unk = tokens[ids["unk"]] if ids["unk"] is not None else None
    model = models.BPE(vocab, merges, unk_token=unk, byte_fallback=BYTE in types)
    tk = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tk.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


def _ugm_model(meta: dict, tokens: list[str], types: list[int], ids: dict, where: str):
    """llama.cpp's "t5" model: a sentencepiece unigram tokenizer (Viterbi), with the normaliser
    the file describes."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    if ids["unk"] is None:
        raise UserInputError("a t5 (unigram) tokenizer needs an unknown token", where)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise UserInputError("a t5 (unigram) tokenizer without tokenizer.ggml.scores", where)
    # llama.cpp scores user-defined tokens 0 so that the lattice prefers them
    pieces = [
        (tok, 0.0 if t == USER_DEFINED else float(s))
        for tok, s, t in zip(tokens, scores, types, strict=True)
    ]
    tk = Tokenizer(models.Unigram(pieces, unk_id=ids["unk"], byte_fallback=False))
    steps = []
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap") or b""
    if charsmap:
        steps.append(normalizers.Precompiled(charsmap))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", False):
        # llama.cpp writes one space before every run of non-spaces (the first included) and
        # drops the others
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
        prefix = True
    if prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    tk.normalizer = normalizers.Sequence(steps)
    tk.decoder = decoders.Metaspace(SPACE, prepend_scheme="always" if prefix else "never")
    return tk


def _post_processor(tokens: list[str], ids: dict, add_bos: bool, add_eos: bool):
    from tokenizers import processors

    bos = [tokens[ids["bos"]]] if add_bos and ids["bos"] is not None else []
    eos = [tokens[ids["eos"]]] if add_eos and ids["eos"] is not None else []
    if not bos and not eos:
        return None
    specials = [(t, ids[k]) for k, ts in (("bos", bos), ("eos", eos)) for t in ts]
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=specials,
    )


def _vocabulary(meta: dict, where: str) -> tuple[list[str], list[int]]:
    """(tokens, token types): every token named once, types and scores for each."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UserInputError("this GGUF has no tokenizer.ggml.tokens", where)
    tokens = [tok or f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]  # llama.cpp's name for ""
    n = len(tokens)
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * n]
    scores = meta.get("tokenizer.ggml.scores")
    if len(types) != n or (scores is not None and len(scores) != n):
        raise UserInputError(
            "tokenizer.ggml.token_type and tokenizer.ggml.scores must list every token", where
        )
    seen: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in seen:  # llama.cpp refuses these files too
            raise UserInputError(
                f"token {tok!r} appears twice in the vocabulary (ids {seen[tok]} and {i})", where
            )
        seen[tok] = i
    return tokens, types


def _save(tk, out_dir: Path, names: dict, template: str | None, add_bos: bool, add_eos: bool):
    """The tokenizer as a Hugging Face folder that transformers and mlx-lm load as it is."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tk, **names)
    if template is not None:
        fast.chat_template = template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")


def write_tokenizer_from_gguf(path: str | Path, out_dir: str | Path) -> dict:
    """Write the tokenizer a GGUF file describes as a Hugging Face tokenizer folder
    (tokenizer.json, tokenizer_config.json and the chat template) in ``out_dir``.

    Returns what was read: the tokenizer model and pre-tokenizer names, the vocabulary size, the
    special token ids, whether BOS/EOS are added, and whether the file has a chat template.
    Raises UserInputError for a tokenizer model or pre-tokenizer that is not supported.
    """
    from tokenizers import AddedToken

    path, out_dir = Path(path), Path(out_dir)
    where = str(path)
    meta = _read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise UserInputError("this GGUF has no tokenizer (tokenizer.ggml.model is missing)", where)
    if kind not in MODELS:
        raise UserInputError(
            f"the GGUF's tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(MODELS)}",
            where,
        )
    tokens, types = _vocabulary(meta, where)
    n = len(tokens)
    ids = _special_ids(meta, kind, n)

    pre_name, add_bos, add_eos = None, False, False
    if kind == "gpt2":
        tk, pre_name, pre = _bpe_model(meta, tokens, where)
        add_bos = pre.add_bos
    elif kind == "llama":
        tk = _spm_model(meta, tokens, types, ids)
        add_bos = True
    else:
        tk = _ugm_model(meta, tokens, types, ids, where)
        add_eos = True
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) and ids["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", add_eos)) and ids["eos"] is not None

    # tokens matched whole before pre-tokenization, as llama.cpp matches them
    special = [tokens[i] for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)]
    user = [tokens[i] for i, t in enumerate(types) if t == USER_DEFINED]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tk.post_processor = _post_processor(tokens, ids, add_bos, add_eos)
    if tk.get_vocab_size(with_added_tokens=True) != n:
        raise UserInputError(
            f"the tokenizer built from this GGUF has {tk.get_vocab_size(True)} tokens, not {n}",
            where,
        )

    template = meta.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    _save(
        tk,
        out_dir,
        {f"{k}_token": tokens[i] for k, i in ids.items() if i is not None},
        template,
        add_bos,
        add_eos,
    )
    return {
        "model": kind,
        "pre": pre_name,
        "vocab_size": n,
        **{f"{k}_token_id": i for k, i in ids.items()},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": template is not None,
    }
