"""The Ollama Modelfile beside a GGUF export: every file it names exists, and its template,
rendered here by a small interpreter of Go's text/template (the subset: text, .Field, if/else
if/else/end, eq, range, whitespace trimming), lays a conversation out exactly as the tokenizer's
own chat template does (Hugging Face's rendering, the BOS token left to the runtime)."""

import json
import re

import pytest

from mlxtune.export.modelfile import modelfile
from mlxtune.tokenizer import load_tokenizer

CHATML_WITH_DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HEADERS_WITH_BOS = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] "
    "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
NO_SYSTEM_ROLE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' "
    "+ message['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


# ------------------------------------------------------------------ a Go text/template subset
def go_render(template: str, data: dict) -> str:
    tokens = []  # ("text", s) | ("action", s)
    pos = 0
    for m in re.finditer(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", template, re.S):
        text = template[pos : m.start()]
        if m.group(1):
            text = text.rstrip()
        if tokens and tokens[-1][0] == "trim_next":
            tokens.pop()
            text = text.lstrip()
        tokens.append(("text", text))
        tokens.append(("action", m.group(2)))
        if m.group(3):
            tokens.append(("trim_next", ""))
        pos = m.end()
    tail = template[pos:]
    if tokens and tokens[-1][0] == "trim_next":
        tokens.pop()
        tail = tail.lstrip()
    tokens.append(("text", tail))
    tree, rest = parse(tokens, 0)
    assert rest == len(tokens)
    return run(tree, data, data)


def parse(tokens, i, stop=("end",)):
    """A list of nodes up to one of ``stop`` (not consumed): text, field, if, range."""
    nodes = []
    while i < len(tokens):
        kind, s = tokens[i]
        if kind == "text":
            nodes.append(("text", s))
            i += 1
            continue
        word = s.split()[0]
        if word in stop or (s.startswith("else") and "else" in stop):
            return nodes, i
        if word == "if":
            branches, i = parse_if(tokens, i)
            nodes.append(("if", branches))
        elif word == "range":
            body, i = parse(tokens, i + 1, ("end",))
            nodes.append(("range", s.split()[1], body))
            i += 1  # end
        else:
            nodes.append(("field", s))
            i += 1
    return nodes, i


def parse_if(tokens, i):
    branches = []
    cond = tokens[i][1][len("if") :].strip()
    i += 1
    while True:
        body, i = parse(tokens, i, ("end", "else"))
        branches.append((cond, body))
        s = tokens[i][1]
        i += 1
        if s == "end":
            return branches, i
        cond = s[len("else if") :].strip() if s.startswith("else if") else None


def value(expr: str, dot, root):
    if expr.startswith("eq "):
        a, b = re.match(r'eq (\S+) "(.*)"', expr).groups()
        return value(a, dot, root) == b
    assert expr.startswith("."), expr
    return dot.get(expr[1:], "") if isinstance(dot, dict) else ""


def run(nodes, dot, root) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "field":
            out.append(str(value(node[1], dot, root)))
        elif node[0] == "if":
            for cond, body in node[1]:
                if cond is None or value(cond, dot, root):
                    out.append(run(body, dot, root))
                    break
        elif node[0] == "range":
            for item in value(node[1], dot, root) or []:
                out.append(run(node[2], item, root))
    return "".join(out)


def test_the_go_interpreter_follows_gos_rules():
    t = '{{- if .System }}S:{{ .System }}\n{{- else }}none {{- end }} [{{ range .Messages }}{{ if eq .Role "user" }}u={{ .Content }}{{ else }}x{{ end }}{{ end }}]'
    msgs = [{"Role": "user", "Content": "a"}, {"Role": "tool", "Content": "b"}]
    assert go_render(t, {"System": "s", "Messages": msgs}) == "S:s [u=ax]"
    assert go_render(t, {"System": "", "Messages": []}) == "none []"


# ------------------------------------------------------------------ the Modelfile
def parse_modelfile(text: str) -> dict:
    """Instructions by name (PARAMETER: a list); a triple-quoted value may span lines."""
    out, rest = {"PARAMETER": []}, text
    while rest.strip():
        rest = rest.lstrip("\n")
        key, _, rest = rest.partition(" ")
        if rest.startswith('"""'):
            val, _, rest = rest[3:].partition('"""')
        else:
            val, _, rest = rest.partition("\n")
        if key == "PARAMETER":
            out["PARAMETER"].append(val)
        else:
            out[key] = val
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three\nlines"},
    ],
]


@pytest.mark.parametrize("template", [CHATML_WITH_DEFAULT_SYSTEM, HEADERS_WITH_BOS])
def test_the_template_renders_conversations_as_the_chat_template_does(tokenizer_dir, template):
    tok = load_tokenizer(tokenizer_dir)
    tok._tokenizer.chat_template = template
    parsed = parse_modelfile(modelfile(tok, "./model.gguf"))
    assert parsed["FROM"] == "./model.gguf" and "TEMPLATE" in parsed
    bos = tok._tokenizer.bos_token
    for conv in CONVERSATIONS:
        want = tok._tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        want = want[len(bos) :] if want.startswith(bos) else want  # the runtime adds BOS
        system = next((m["content"] for m in conv if m["role"] == "system"), "")
        msgs = [{"Role": m["role"], "Content": m["content"]} for m in conv]
        got = go_render(parsed["TEMPLATE"], {"System": system, "Messages": msgs})
        assert got == want, (conv, got, want)
    stops = [json.loads(p.split(" ", 1)[1]) for p in parsed["PARAMETER"] if p.startswith("stop")]
    assert tok._tokenizer.eos_token in stops
    end = "<|im_end|>" if "im_end" in template else "<|eot_id|>"
    assert end in stops


def test_a_template_that_does_not_line_up_gets_no_go_template(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    tok._tokenizer.chat_template = NO_SYSTEM_ROLE
    parsed = parse_modelfile(modelfile(tok, "./model.gguf"))
    assert "TEMPLATE" not in parsed  # Ollama reads the GGUF's own chat template then
    assert parsed["PARAMETER"] == [f"stop {json.dumps(tok._tokenizer.eos_token)}"]


def test_gguf_exports_write_a_modelfile_naming_files_that_exist(tmp_path, data_dir, llama_dir):
    from test_export import trained_run

    from mlxtune.cli import main

    (llama_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    try:
        trained_run(tmp_path, data_dir, llama_dir, "lora", ["gguf-adapter"])
        assert main(["export", str(tmp_path / "lora"), "--format", "gguf", "--dtype", "f32"]) == 0
    finally:
        (llama_dir / "generation_config.json").unlink()
    for fmt in ("gguf", "gguf-adapter"):
        folder = tmp_path / "lora" / "export" / fmt
        parsed = parse_modelfile((folder / "Modelfile").read_text())
        for key in ("FROM", "ADAPTER"):
            if key in parsed:
                p = parsed[key]
                assert (folder / p if p.startswith("./") else tmp_path / p).exists(), (fmt, p)
        assert "temperature 0.6" in parsed["PARAMETER"]
    adapter = parse_modelfile((tmp_path / "lora/export/gguf-adapter/Modelfile").read_text())
    assert adapter["FROM"] == str(llama_dir.resolve()) and adapter["ADAPTER"].endswith(".gguf")
