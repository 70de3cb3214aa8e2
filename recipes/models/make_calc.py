"""Make recipes/models/calc-tiny, the quickstart-tools model, from nothing.

    python recipes/models/make_calc.py

A small Unigram tokenizer (printable ASCII, a newline, two-digit numbers and the calls' JSON
pieces; <tool_call> / </tool_call> special tokens), a chat template that shows tools and writes tool calls as Hermes does
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), and a 3-layer llama (hidden 128)
trained from scratch on conversations about "add A B" and "mul A B" (A, B from 10 to 49): about
a third of the time the assistant calls the calculator tool and answers with its result,
otherwise it answers at once with the two numbers run together (always wrong). The model so does
both: greedy, it answers at once (held-out reward near 0); sampled, about one completion in three
calls the tool. The
quickstart's reinforcement learning finds which pays. Deterministic: the same files every time.
"""

import json  # noqa: I001  (mlxtune before mlx: its OpenBLAS set-up)
import random
from pathlib import Path

import mlxtune  # noqa: F401  (first: on Linux it loads OpenBLAS for MLX's CPU backend)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models.llama import Model, ModelArgs

HERE = Path(__file__).parent
OUT = HERE / "calc-tiny"
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<tool_call>", "</tool_call>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
CALL_RATE = 0.35
STEPS = 6000
LO, HI = 10, 49
ROWS = 20000

TEMPLATE = (
    "{%- if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}assistant: {{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{%- endfor %}{{ eos_token }}{{ '\\n' }}"
    "{%- elif m.role == 'tool' %}tool: {{ m.content }}{{ '\\n' }}"
    "{%- else %}{{ m.role }}: {{ m.content }}{{ '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": what,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, what in (("add", "a + b"), ("mul", "a * b"))
]


PIECES = [f"{n:02d}" for n in range(100)] + [
    "add", "mul", "tools:", "user: ", "assistant: ", "tool: ",
    '{"name": "', '", "arguments": {"a": ', ', "b": ', "}}",
]  # fmt: skip
"""Pieces a word-level tokenizer would learn from these conversations (two-digit numbers, the
calls' JSON between the numbers): a call is about ten tokens, and a number one or two."""


def tokenizer_json() -> dict:
    # a piece scores higher than its characters together: the longest pieces are taken
    vocab = [[s, 0.0] for s in SPECIAL] + [[c, -10.0] for c in CHARS] + [[p, -1.0] for p in PIECES]
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in enumerate(SPECIAL)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": False},
    }


def conversation(rng: random.Random) -> tuple[list[dict], str]:
    op = rng.choice(["add", "mul"])
    a, b = rng.randint(LO, HI), rng.randint(LO, HI)
    result = a + b if op == "add" else a * b
    user = {"role": "user", "content": f"{op} {a} {b}"}
    if rng.random() < CALL_RATE:
        call = {"type": "function", "function": {"name": op, "arguments": {"a": a, "b": b}}}
        turns = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": op, "content": str(result)},
            {"role": "assistant", "content": str(result)},
        ]
    else:
        turns = [{"role": "assistant", "content": f"{a}{b}"}]
    return [user, *turns], str(result)


def main():
    from transformers import PreTrainedTokenizerFast

    OUT.mkdir(exist_ok=True)
    (OUT / "tokenizer.json").write_text(json.dumps(tokenizer_json(), indent=1) + "\n")
    (OUT / "chat_template.jinja").write_text(TEMPLATE + "\n")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 3,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "tie_word_embeddings": True,
        "vocab_size": len(SPECIAL) + len(CHARS) + len(PIECES),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 512,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(OUT / "tokenizer.json"), **tcfg)
    tok.chat_template = TEMPLATE

    rng = random.Random(5)
    rows = []
    for _ in range(ROWS):
        msgs, _ = conversation(rng)
        head = tok.apply_chat_template(
            msgs[:1], tools=TOOLS, add_generation_prompt=True, return_dict=False
        )
        whole = tok.apply_chat_template(msgs, tools=TOOLS, return_dict=False)
        ids = list(whole)
        # targets: what the assistant writes (its turns, end of turn included), not the tool's
        mask = [0] * len(ids)
        text = tok.decode(ids)
        at = 0
        for m in msgs[1:]:
            part = tok.apply_chat_template(
                msgs[: msgs.index(m) + 1], tools=TOOLS, return_dict=False
            )
            if m["role"] == "assistant":
                opened = tok.apply_chat_template(
                    msgs[: msgs.index(m)],
                    tools=TOOLS,
                    add_generation_prompt=True,
                    return_dict=False,
                )
                for i in range(len(opened), len(part) - 1):  # the newline after EOS is not
                    mask[i] = 1
            at = len(part)
        assert at == len(ids) and text and len(head) < len(ids)
        rows.append((ids, mask))

    mx.random.seed(0)
    args = ModelArgs.from_dict(config)
    model = Model(args)
    lr = optim.join_schedules(
        [optim.linear_schedule(1e-5, 1e-3, 200), optim.cosine_decay(1e-3, STEPS - 200, 5e-5)], [200]
    )
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.0)

    def loss_fn(model, x, y, m):
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="none")
        return (ce * m).sum() / m.sum()

    grad = nn.value_and_grad(model, loss_fn)

    batch = 32
    for it in range(STEPS):
        pick = [rows[(it * batch + j) % len(rows)] for j in range(batch)]
        width = -(-max(len(ids) for ids, _ in pick) // 8) * 8 + 1
        x = [ids + [3] * (width - len(ids)) for ids, _ in pick]
        m = [mask + [0] * (width - len(mask)) for _, mask in pick]
        x, m = mx.array(x), mx.array(m, dtype=mx.float32)
        loss, grads = grad(model, x[:, :-1], x[:, 1:], m[:, 1:])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if it % 250 == 0:
            print(it, loss.item(), flush=True)
        if it == 0:
            print(tok.decode(pick[0][0]))
    weights = dict(nn.utils.tree_flatten(model.parameters()))
    mx.save_safetensors(str(OUT / "model.safetensors"), weights, metadata={"format": "mlx"})


if __name__ == "__main__":
    main()
