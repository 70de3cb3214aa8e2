"""Make recipes/models/reverse-tiny-small, the quickstart-distill student, from the teacher.

    python recipes/models/make_student.py

The teacher, recipes/models/reverse-tiny, is the quickstart's model (2 llama layers, hidden
128, MLP 256). The student keeps its embeddings and attention and cuts each MLP to its first 16
units: 0.14M parameters against 0.33M, the same family and vocabulary. It answers about 5% of
the held-out words right until distillation teaches it the rest (prune, then distill, as
Minitron does). Deterministic: the same files every time.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).parent
KEEP = 16


def main():
    src, out = HERE / "reverse-tiny", HERE / "reverse-tiny-small"
    out.mkdir(exist_ok=True)
    weights = {}
    for k, v in mx.load(str(src / "model.safetensors")).items():
        if k.endswith(("gate_proj.weight", "up_proj.weight")):
            v = v[:KEEP]
        elif k.endswith("down_proj.weight"):
            v = v[:, :KEEP]
        weights[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = KEEP
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in (
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        shutil.copy(src / name, out / name)


if __name__ == "__main__":
    main()
