"""An Ollama Modelfile beside a GGUF export: ``FROM`` the model (or the base, with ``ADAPTER``
the LoRA GGUF), the chat template as Ollama's Go template, its stop strings, and the base's
sampling defaults (generation_config.json), so that ``ollama create NAME -f Modelfile`` runs the
result.

The Go template is derived, not looked up: the tokenizer's own chat template renders a few probe
conversations, and what it puts before and after each message's text becomes the template's
pieces (the text before a user message, the text between it and the answer, which is also the
generation prompt, the text after an answer, a system message's wrapper, and what the template
adds when there is no system message). A template that does not wrap each message alike (its
probes do not line up) gets none: the GGUF's own ``tokenizer.chat_template`` is then what
Ollama reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MARK = {"system": "SYSMARKq7", "user": "USRMARKq7", "assistant": "ASTMARKq7"}
"""Probe texts no template adds or changes."""


@dataclass
class Pieces:
    """What a chat template puts around each message."""

    head: str  # before the first user message when there is no system message
    system_pre: str
    system_post: str  # after the system text, before the first user message's own prefix
    user_pre: str
    mid: str  # after a user message's text: the assistant's header (also the generation prompt)
    assistant_post: str


def _render(tok, messages, gen: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _between(text: str, a: str, b: str) -> str:
    i = text.index(a) + len(a)
    return text[i : text.index(b, i)]


def chat_pieces(tokenizer) -> Pieces | None:
    """The pieces of ``tokenizer``'s chat template (its Hugging Face tokenizer's), or None when
    it has none or they do not line up message by message."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    if not getattr(tok, "chat_template", None):
        return None
    s, u, a = MARK["system"], MARK["user"], MARK["assistant"]
    u2, a2 = u + "b", a + "b"
    try:
        gen = _render(tok, [{"role": "user", "content": u}], True)
        one = _render(
            tok, [{"role": "user", "content": u}, {"role": "assistant", "content": a}], False
        )
        two = _render(
            tok,
            [
                {"role": "user", "content": u},
                {"role": "assistant", "content": a},
                {"role": "user", "content": u2},
                {"role": "assistant", "content": a2},
            ],
            False,
        )
        sys_gen = _render(
            tok, [{"role": "system", "content": s}, {"role": "user", "content": u}], True
        )
    except Exception:  # a template that refuses a probe (no system role, ...)
        return None
    bos = tok.bos_token or ""
    mid = _between(one, u, a)
    if gen[gen.index(u) + len(u) :] != mid:
        return None
    assistant_post = one[one.index(a) + len(a) :]
    between = _between(two, a, u2)  # an answer's end, then the next user message's start
    if not between.startswith(assistant_post):
        return None
    user_pre = between[len(assistant_post) :]
    head = gen[: gen.index(u)]
    if not head.endswith(user_pre) or _between(two, u2, a2) != mid:
        return None
    head = head[: len(head) - len(user_pre)]
    before_s, after_s = sys_gen[: sys_gen.index(s)], _between(sys_gen, s, u)
    if not after_s.endswith(user_pre):
        return None
    # the BOS token is the runtime's to add (GGUF add_bos_token), not the template's
    head = head[len(bos) :] if bos and head.startswith(bos) else head
    before_s = before_s[len(bos) :] if bos and before_s.startswith(bos) else before_s
    return Pieces(
        head, before_s, after_s[: len(after_s) - len(user_pre)], user_pre, mid, assistant_post
    )


def go_template(p: Pieces) -> str:
    """The pieces as an Ollama (Go) template over ``.System`` and ``.Messages``."""
    # no {{- trimming: the pieces' own whitespace (a newline after a turn) is part of them
    return (
        "{{ if .System }}" + p.system_pre + "{{ .System }}" + p.system_post
        + "{{ else }}" + p.head + "{{ end }}"
        + "{{ range .Messages }}"
        + '{{ if eq .Role "user" }}' + p.user_pre + "{{ .Content }}" + p.mid
        + '{{ else if eq .Role "assistant" }}{{ .Content }}' + p.assistant_post
        + "{{ end }}{{ end }}"
    )  # fmt: skip


def stops(tokenizer, p: Pieces | None) -> list[str]:
    """The strings that end an answer: the EOS token, and the text after an answer."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    out = [tok.eos_token] if getattr(tok, "eos_token", None) else []
    end = p.assistant_post.strip() if p is not None else ""
    if end and end not in out:
        out.append(end)
    return out


SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
"""generation_config.json keys -> Modelfile PARAMETER names."""


def sampling_defaults(base_dir) -> dict:
    """The base model's sampling defaults (its generation_config.json), where it has one."""
    if base_dir is None or not Path(base_dir).is_dir():
        return {}
    f = Path(base_dir) / "generation_config.json"
    if not f.exists():
        return {}
    cfg = json.loads(f.read_text())
    if cfg.get("do_sample") is False:
        return {}
    return {SAMPLING[k]: cfg[k] for k in SAMPLING if isinstance(cfg.get(k), (int, float))}


def modelfile(tokenizer, from_: str, adapter: str | None = None, base_dir=None) -> str:
    """A Modelfile's text: FROM ``from_`` (a file beside it: ``./NAME``), ADAPTER, TEMPLATE,
    PARAMETER stop and the sampling defaults."""
    lines = [f"FROM {from_}"]
    if adapter is not None:
        lines.append(f"ADAPTER {adapter}")
    pieces = chat_pieces(tokenizer)
    if pieces is not None:
        lines.append(f'TEMPLATE """{go_template(pieces)}"""')
    for s in stops(tokenizer, pieces):
        lines.append(f"PARAMETER stop {json.dumps(s)}")
    for k, v in sampling_defaults(base_dir).items():
        lines.append(f"PARAMETER {k} {v}")
    return "\n".join(lines) + "\n"
