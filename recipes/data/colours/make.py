"""Writes the colours task that recipes/quickstart-vision.yaml trains on (run from anywhere;
the files it writes are shipped, so the recipe needs nothing of this script):

- img/*.png: a shape (square or disc) of one of four colours, at a random place and size, on a
  grey background, in images of 56 x 56, 84 x 56 or 56 x 84 pixels;
- train.jsonl, valid.jsonl, test.jsonl: chats asking the shape's colour, the image a content
  part ({"type": "image", "image": "img/....png"}), the answer the colour's name;
- tokenizer/: a byte-level tokenizer with Qwen2-VL's special tokens and a chat template that
  shows an image part as <|vision_start|><|image_pad|><|vision_end|>, and the image processor's
  preprocessor_config.json (14-pixel patches, 2 x 2 merged into a token).
"""

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).parent
COLOURS = {
    "red": (210, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 60, 210),
    "yellow": (220, 200, 40),
}
SIZES = [(56, 56), (84, 56), (56, 84)]
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
}


def picture(rng: random.Random, path: Path) -> str:
    name = rng.choice(sorted(COLOURS))
    w, h = rng.choice(SIZES)
    grey = rng.randint(120, 160)
    im = Image.new("RGB", (w, h), (grey, grey, grey))
    side = rng.randint(min(w, h) // 3, min(w, h) * 2 // 3)
    x, y = rng.randint(0, w - side), rng.randint(0, h - side)
    rgb = tuple(max(0, min(255, v + rng.randint(-25, 25))) for v in COLOURS[name])
    draw = ImageDraw.Draw(im)
    (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x, y, x + side, y + side], fill=rgb)
    im.save(path, optimize=True)
    return name


def main():
    rng = random.Random(0)
    (HERE / "img").mkdir(exist_ok=True)
    for split, n in (("train", 240), ("valid", 24), ("test", 40)):
        rows = []
        for i in range(n):
            rel = f"img/{split}-{i:03d}.png"
            name = picture(rng, HERE / rel)
            question = [
                {"type": "image", "image": rel},
                {"type": "text", "text": "What colour is the shape?"},
            ]
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": name},
                    ]
                }
            )
        (HERE / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(HERE / "tokenizer")
    (HERE / "tokenizer" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2))


if __name__ == "__main__":
    main()
