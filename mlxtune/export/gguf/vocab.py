"""A GGUF file's tokenizer fields, written from the tokenizer a model was trained with: a
byte-level BPE vocabulary as llama.cpp's "gpt2" tokenizer model (its pre-tokenizer by the name
llama.cpp gives its splits), a sentencepiece one as "llama" or "t5", or a GGUF base's fields
copied as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import UserInputError
from ...gguf.file import open_gguf
from ...gguf.tokenizer import BPE_PRE, EXPORT_PRE_NAMES, GPT2_SPLIT

# Split patterns of byte-level BPE pre-tokenizers -> the names llama.cpp knows them by (the
# table GGUF import reads them back with, so that export and import agree)
_PRE_PATTERNS = EXPORT_PRE_NAMES


def _bpe_pre_name(data: dict) -> str:
    """llama.cpp's name for a tokenizer.json's pre-tokenizer: its Split patterns in order (and
    GPT-2's, where the ByteLevel step splits by its own regex) as one of llama.cpp's
    pre-tokenizers splits (UserInputError when none does)."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    level = next((s for s in steps if s.get("type") == "ByteLevel"), None)
    if level is not None and level.get("use_regex", True):
        splits.append(GPT2_SPLIT)
    if len(splits) == 1 and splits[0] in _PRE_PATTERNS:
        return _PRE_PATTERNS[splits[0]]
    # the first of llama.cpp's names that splits so (a family of names shares one entry)
    name = next(
        (n for n, p in BPE_PRE.items() if n != "default" and p.splits == tuple(splits)), None
    )
    if name is not None:
        return name
    raise UserInputError(
        "this BPE tokenizer's pre-tokenizer is not one llama.cpp knows (GPT-2, Llama 3, Qwen2, "
        "SmolLM/StarCoder and the others of gguf.tokenizer.BPE_PRE are)",
        "export --format gguf",
    )


def _add_bpe_tokenizer(w, tokenizer):
    """A byte-level BPE vocabulary (tokenizer.json) as llama.cpp's "gpt2" tokenizer model."""
    import json

    import gguf

    fast = tokenizer._tokenizer
    data = json.loads(fast.backend_tokenizer.to_str())
    model = data["model"]
    n = len(fast)
    tokens: list[str | None] = [None] * n
    types = [int(gguf.TokenType.NORMAL)] * n
    for tok, i in model["vocab"].items():
        tokens[i] = tok
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(
            gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        )
    for i, tok in enumerate(tokens):  # holes in the ids, filled as llama.cpp's converter fills them
        if tok is None:
            tokens[i], types[i] = f"[PAD{i}]", int(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_bpe_pre_name(data))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key in ("bos", "eos", "unk", "pad"):
        tid = getattr(fast, f"{key}_token_id", None)
        if tid is not None:
            getattr(w, f"add_{key}_token_id")(tid)
    # whether BOS/EOS are added shows in what the tokenizer does (its post-processor), which a
    # tokenizer_config.json flag need not mirror
    plain, full = fast.encode("a", add_special_tokens=False), fast.encode("a")
    bos, eos = fast.bos_token_id, fast.eos_token_id
    w.add_add_bos_token(bos is not None and len(full) > len(plain) and full[0] == bos)
    w.add_add_eos_token(eos is not None and len(full) > len(plain) and full[-1] == eos)
    template = getattr(fast, "chat_template", None)
    if isinstance(template, str):
        w.add_chat_template(template)


def _is_bpe(tokenizer) -> bool:
    backend = getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    return backend is not None and type(backend.model).__name__ == "BPE"


def _add_tokenizer(w, tokenizer_dir: Path | None, tokenizer):
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as pb

    spm_path = tokenizer_dir / "tokenizer.model" if tokenizer_dir else None
    if spm_path is None or not spm_path.exists():
        if _is_bpe(tokenizer):
            return _add_bpe_tokenizer(w, tokenizer)
        raise UserInputError(
            "GGUF export needs a sentencepiece tokenizer.model or a BPE tokenizer.json",
            "export --format gguf",
        )
    proto = pb.ModelProto()
    proto.ParseFromString(spm_path.read_bytes())
    types = {
        pb.ModelProto.SentencePiece.NORMAL: gguf.TokenType.NORMAL,
        pb.ModelProto.SentencePiece.UNKNOWN: gguf.TokenType.UNKNOWN,
        pb.ModelProto.SentencePiece.CONTROL: gguf.TokenType.CONTROL,
        pb.ModelProto.SentencePiece.USER_DEFINED: gguf.TokenType.USER_DEFINED,
        pb.ModelProto.SentencePiece.UNUSED: gguf.TokenType.UNUSED,
        pb.ModelProto.SentencePiece.BYTE: gguf.TokenType.BYTE,
    }
    if proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM:
        # llama.cpp's "llama" tokenizer merges pieces by score (sentencepiece BPE); a unigram
        # model needs its Viterbi tokenizer ("t5", UGM) and the normaliser's character map.
        w.add_tokenizer_model("t5")
        w.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
        w.add_remove_extra_whitespaces(bool(proto.normalizer_spec.remove_extra_whitespaces))
    else:
        w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([p.piece.encode("utf-8") for p in proto.pieces])
    w.add_token_scores([float(p.score) for p in proto.pieces])
    w.add_token_types([int(types[p.type]) for p in proto.pieces])
    spec = proto.trainer_spec
    for key, tid in (
        ("bos", spec.bos_id),
        ("eos", spec.eos_id),
        ("unk", spec.unk_id),
        ("pad", spec.pad_id),
    ):
        if tid >= 0:
            getattr(w, f"add_{key}_token_id")(tid)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(bool(proto.normalizer_spec.add_dummy_prefix))
    template = (
        getattr(tokenizer._tokenizer, "chat_template", None) if tokenizer is not None else None
    )
    if isinstance(template, str):
        w.add_chat_template(template)


def _copy_tokenizer(w, source: Path, template: str | None):
    """Every ``tokenizer.*`` field of a GGUF file, as it is there (a GGUF base's own
    vocabulary, which llama.cpp reads back exactly), with ``template`` as the chat template
    when one is given."""
    import gguf

    f = open_gguf(source)
    for key, value in f.fields.items():
        if not key.startswith("tokenizer.") or (
            key == "tokenizer.chat_template" and template is not None
        ):
            continue
        vtype, sub = f.types[key]
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(value) == 0:
                continue
            value = value.tolist() if isinstance(value, np.ndarray) else value
            w.add_key_value(key, value, gguf.GGUFValueType(vtype), gguf.GGUFValueType(sub))
        else:
            w.add_key_value(key, value, gguf.GGUFValueType(vtype))
    if template is not None:
        w.add_chat_template(template)


def tokenizer_fields(w, tokenizer, tokenizer_dir: Path | None, tokenizer_gguf: Path | None):
    """The tokenizer's fields: a GGUF base's copied as they are (with the run's chat template),
    else written from the tokenizer folder."""
    if tokenizer_gguf is not None:
        template = getattr(getattr(tokenizer, "_tokenizer", None), "chat_template", None)
        _copy_tokenizer(w, Path(tokenizer_gguf), template if isinstance(template, str) else None)
    else:
        _add_tokenizer(w, tokenizer_dir, tokenizer)
