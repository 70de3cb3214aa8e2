"""Tokenizers: load a model's own, or train a sentencepiece model on the recipe's corpus.

A trained tokenizer is written as ``tokenizer.model`` (sentencepiece) plus ``tokenizer.json`` /
``tokenizer_config.json`` (Hugging Face tokenizers), converted losslessly (same ids as
sentencepiece), so that mlx-lm, transformers and a later recipe all load it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .errors import UserInputError
from .gguf.file import is_gguf
from .gguf.tokenizer import write_tokenizer_from_gguf
from .safety import code_files

SPECIALS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}

# Plain-text roles, so chat data works with a tokenizer that has no role tokens.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def load_tokenizer(
    path: str | Path, chat_template: str | None = None, trust_remote_code: bool = False
):
    """Load the tokenizer in a model directory as mlx-lm's TokenizerWrapper. A tokenizer that
    asks to run its own Python code (tokenizer_config.json's auto_map) is refused unless
    ``trust_remote_code``."""
    # mlx_lm's tokenizer utilities pull in transformers: imported when a tokenizer loads
    from mlx_lm.tokenizer_utils import load as load_wrapper

    path = Path(path)
    if not path.is_dir():
        raise UserInputError("tokenizer directory not found", str(path))
    names = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}
    if not any((path / n).exists() for n in names):
        raise UserInputError(
            "no tokenizer files (tokenizer.json or tokenizer.model) here", str(path)
        )
    cfg_path = path / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"not valid JSON: {e}", str(cfg_path)) from None
    code = code_files(path, cfg) if isinstance(cfg, dict) else []
    if code and not trust_remote_code:
        raise UserInputError(
            f"this tokenizer asks to run its own Python code ({', '.join(code)}), which runs "
            "only when the recipe sets model.trust_remote_code: true",
            str(cfg_path),
        )
    try:
        # never transformers' interactive prompt: the recipe decides
        tok = load_wrapper(path, {"trust_remote_code": trust_remote_code})
    except Exception as e:  # transformers raises many kinds
        message = " ".join(str(e).split())  # one line: transformers' can run over several
        raise UserInputError(f"cannot load the tokenizer: {message}", str(path)) from None
    if chat_template is not None:
        tok._tokenizer.chat_template = chat_template
    return tok


def model_tokenizer(
    path: str | Path,
    *,
    keep_in: str | Path | None = None,
    trust_remote_code: bool = False,
    log=None,
):
    """The tokenizer of a model: its folder's own, or a GGUF file's, written out from the file's
    metadata as a folder. ``keep_in``: where that folder stays (a run's own copy, reused when it
    is there already; ``log`` hears what was read); without it, a temporary folder."""
    path = Path(path)
    if not is_gguf(path):
        return load_tokenizer(path, trust_remote_code=trust_remote_code)
    if keep_in is None:
        with tempfile.TemporaryDirectory() as tmp:
            write_tokenizer_from_gguf(path, tmp)
            return load_tokenizer(tmp)
    folder = Path(keep_in)
    if not (folder / "tokenizer.json").exists():
        info = write_tokenizer_from_gguf(path, folder)
        if log is not None:
            log(
                f"tokenizer from the GGUF metadata: {info['model']} "
                f"({info['pre'] or 'no pre-tokenizer'}), {info['vocab_size']} tokens"
                + (", with its chat template" if info.get("chat_template") else "")
            )
    return load_tokenizer(folder)


def train_sentencepiece(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    max_sentences: int = 200000,
    seed: int = 0,
):
    """Train a sentencepiece model on ``texts``, save it in both formats, return the wrapper."""
    import sentencepiece as spm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [t.replace("\n", " ") for t in texts if t and t.strip()]
    if not lines:
        raise UserInputError("no text to train the tokenizer on", "tokenizer.train")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            f.write("\n".join(lines[:max_sentences]))
        prefix = os.path.join(tmp, "spm")
        try:
            spm.SentencePieceTrainer.train(
                input=corpus,
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=3,
                unk_piece=SPECIALS["unk"],
                bos_piece=SPECIALS["bos"],
                eos_piece=SPECIALS["eos"],
                pad_piece=SPECIALS["pad"],
                hard_vocab_limit=model_type != "char",
                num_threads=min(os.cpu_count() or 1, 8),
                minloglevel=2,
            )
        except RuntimeError as e:
            raise UserInputError(
                f"sentencepiece could not train: {str(e).splitlines()[-1]}", "tokenizer.train"
            ) from None
        model_bytes = Path(prefix + ".model").read_bytes()
    (out_dir / "tokenizer.model").write_bytes(model_bytes)
    write_hf_tokenizer(model_bytes, out_dir)
    return load_tokenizer(out_dir)


def sentencepiece_to_tokenizers(model_bytes: bytes):
    """A ``tokenizers.Tokenizer`` that encodes exactly as the sentencepiece model does.

    Supports unigram and char models (the ones mlxtune trains): both are a Unigram model over
    the same pieces and scores, after sentencepiece's default nmt_nfkc normalisation.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, processors

    proto = pb.ModelProto()
    proto.ParseFromString(model_bytes)
    kind = proto.trainer_spec.model_type
    if kind not in (pb.TrainerSpec.UNIGRAM, pb.TrainerSpec.CHAR):
        raise ValueError("only unigram and char sentencepiece models convert losslessly")
    vocab = [(p.piece, p.score) for p in proto.pieces]
    tk = Tokenizer(models.Unigram(vocab, unk_id=proto.trainer_spec.unk_id, byte_fallback=False))
    steps = [normalizers.NFKC()] if proto.normalizer_spec.name.startswith("nmt_nfkc") else []
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if proto.normalizer_spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tk.normalizer = normalizers.Sequence(steps)
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    bos = SPECIALS["bos"]
    bos_id = proto.trainer_spec.bos_id
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return tk


def write_hf_tokenizer(model_bytes: bytes, out_dir: Path):
    from transformers import PreTrainedTokenizerFast

    tk = sentencepiece_to_tokenizers(model_bytes)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=SPECIALS["bos"],
        eos_token=SPECIALS["eos"],
        unk_token=SPECIALS["unk"],
        pad_token=SPECIALS["pad"],
    )
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # Name the class so that loaders which dispatch on it pick the fast tokenizer.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def save_tokenizer(tokenizer, out_dir: str | Path, source_dir: str | Path | None = None):
    """Save a tokenizer into a model directory (with tokenizer.model when there is one)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer._tokenizer.save_pretrained(str(out_dir))
    if source_dir is not None and (Path(source_dir) / "tokenizer.model").exists():
        (out_dir / "tokenizer.model").write_bytes(
            (Path(source_dir) / "tokenizer.model").read_bytes()
        )


def tokenizer_texts(rows: list[tuple[int, dict]]) -> list[str]:
    """The texts of data rows ((line, row) pairs) a tokenizer is trained on: every text field
    and the content of every chat message, in order."""
    out = []
    for _, obj in rows:
        for key in (
            "text",
            "prompt",
            "completion",
            "instruction",
            "input",
            "output",
            "chosen",
            "rejected",
        ):
            if isinstance(obj.get(key), str):
                out.append(obj[key])
        for key in ("messages", "prompt", "chosen", "rejected"):  # chat: lists of messages
            for m in obj.get(key) if isinstance(obj.get(key), list) else []:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    out.append(m["content"])
    return out
