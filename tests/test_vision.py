"""Vision-language models: the forward against mlx-vlm's own, image chats encoded and masked,
bad image rows, and a run that trains on images."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from PIL import Image

from conftest import (
    build_run,
    make_crash,
    measured_peak,
    run_rows,
    same_rows,
    shake_adapters,
    tiny_recipe,
    write_jsonl,
)
from mlxtune.adapters import apply_adapters
from mlxtune.data import Encoder, make_batch, make_packed_batch
from mlxtune.errors import UserInputError
from mlxtune.evaluate import evaluate_run
from mlxtune.export import export
from mlxtune.export.mlx_vlm import hf_vision_weights
from mlxtune.generate import generate_ids
from mlxtune.memory import estimate, shape_of
from mlxtune.models import (
    VISION_FAMILIES,
    images,
    kernel_attention,
    lm_parts,
    load_image_tokens,
    load_vision_model,
    step_images,
)
from mlxtune.models.vision import FEATURE_ROWS
from mlxtune.runs.checkpoint import load_checkpoint
from mlxtune.tokenizer import load_tokenizer
from vision_models import COLOURS, VISION_ARCHS, build_vision_dir, colour_rows


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_vision_dir(tmp_path_factory.mktemp("qwen2_vl") / "model")


@pytest.fixture(scope="module", params=sorted(VISION_ARCHS))
def family_dir(request, tmp_path_factory):
    """A tiny model of each family mlxtune trains."""
    return build_vision_dir(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Three noise images of different sizes (so different grids)."""
    folder = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    out = []
    for i, (h, w) in enumerate([(60, 80), (100, 200), (56, 56)]):
        p = folder / f"p{i}.png"
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(p)
        out.append(p)
    return out


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def two_rows(model, pictures, folder: Path):
    """Token rows (two images in the first, one in the second; one marker each, as a chat
    template writes them) expanded as the family's processor expands them, right-padded."""
    it = model.image_tokens
    layouts = it.layouts(pictures, "test")
    tok = load_tokenizer(folder)
    m = [it.family.marker_id]
    if it.family.mrope:  # Qwen's template frames it: <|vision_start|> <|image_pad|> <|vision_end|>
        m = [259, *m, 260]
    rows = [[5, 10, 11, *m, 12, 13, *m, 14, 6], [5, 20, *m, 21, 22, 23, 24, 6]]
    e0 = it.expand(rows[0], [0] * len(rows[0]), layouts[:2], tok, "r0")[0]
    e1 = it.expand(rows[1], [0] * len(rows[1]), layouts[2:], tok, "r1")[0]
    tokens = np.full((2, max(len(e0), len(e1))), 7, np.int64)
    tokens[0, : len(e0)], tokens[1, : len(e1)] = e0, e1
    return tokens, [e0, e1], [pictures[:2], pictures[2:]]


def mlx_vlm_logits(model, ids, files):
    """mlx-vlm's own forward of one unpadded row: its processor's pixels and its merge of the
    image features (Qwen2-VL's rotary index its own too)."""
    it, vlm = model.image_tokens, model.vlm
    x = mx.array([ids])
    if it.family.name.startswith("qwen"):
        px = it.process(files, "test")
        lm = vlm.language_model
        lm._position_ids = lm._rope_deltas = None  # mlx-vlm keeps them from the last call
        return vlm(
            x, mx.array(px["pixel_values"]), mask=None, image_grid_thw=mx.array(px["image_grid"])
        ).logits[0]
    pictures = [Image.open(f).convert("RGB") for f in files]
    if it.family.name == "gemma3":  # the embeddings as mlx-vlm merges them, its causal LM
        px = it.processor(images=pictures, return_tensors="np")["pixel_values"]
        embeds = vlm.get_input_embeddings(x, mx.array(px), mask=mx.ones(x.shape)).inputs_embeds
        return vlm.language_model(x, inputs_embeds=embeds).logits[0]
    if it.family.name == "llava":
        px = it.processor(images=pictures, return_tensors="np")["pixel_values"]
        return vlm(x, mx.array(px), mask=None).logits[0]
    if it.family.name == "mistral3":
        out = it.processor(images=pictures, return_tensors="np")
        sizes = mx.array(np.asarray(out["image_sizes"]))
        return vlm(x, mx.array(out["pixel_values"]), mask=None, image_sizes=sizes).logits[0]
    # Idefics3 / SmolVLM: one sample of all the row's pictures, padding tiles and all
    out = it.processor(images=[[p] for p in pictures], return_tensors="np")
    px, pm = (np.asarray(out[k]) for k in ("pixel_values", "pixel_attention_mask"))
    px, pm = px.reshape(1, -1, *px.shape[2:]), pm.reshape(1, -1, *pm.shape[2:])
    return vlm(x, mx.array(px), pixel_attention_mask=mx.array(pm)).logits[0]


def our_logits(model, tokens, files):
    arrays = {k: mx.array(v) for k, v in model.batch_arrays(tokens, files).items()}
    with images(step_images(model.prepare(arrays))):
        return model(mx.array(tokens))


def image_run(tmp_path, family, adapter, steps=6, **train):
    """A recipe dict of SFT on colour chats for a tiny model of ``family`` (its folder
    returned too)."""
    folder = build_vision_dir(tmp_path / "model", family)
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", colour_rows(data, "train", 16))
    write_jsonl(data / "valid.jsonl", colour_rows(data, "valid", 4))
    r = tiny_recipe(
        data,
        folder,
        adapter=adapter,
        train={"batch_size": 4, "max_steps": steps, "log_every": 1, "progress": False, **train},
    )
    r["data"]["max_length"] = 128  # a SmolVLM picture: up to 5 tiles of 6 tokens, and tags
    return r, folder


TOWER_LORA = {
    "type": "lora",
    "rank": 4,
    "alpha": 8,
    "targets": ["all-linear", "vision", "projector"],
}


LORA_ALL = {"type": "lora", "rank": 4, "alpha": 8, "targets": ["all-linear"]}


# each family's image tokens for the three pictures, by hand. Qwen2-VL: sides rounded to 28
# within 3136-12544 pixels, 14-pixel patches merged 2 x 2: 60 x 80 -> 56 x 84 (6), 100 x 200 ->
# 56 x 140 (10), 56 x 56 (4). Qwen3-VL: 16-pixel patches, sides multiples of 32 within 4096-16384
# pixels: 64 x 64 (4), 64 x 160 (10), 64 x 64 (4). Gemma 3: 4 each. SmolVLM: the longest side to 112, cut into
# 56-pixel tiles (2 x 2, 1 x 2, 2 x 2) plus the whole picture, 4 tokens a tile (and Idefics3).
# LLaVA: the centre 56 x 56, a token a 14-pixel patch (16). Mistral 3: sides within 112 rounded
# up to 14, a token a 28-pixel square: 60 x 80 -> 70 x 84 (2 x 3), 100 x 200 -> 56 x 112
# (2 x 4), 56 x 56 (2 x 2).
IMAGE_COUNTS = {
    "qwen2_vl": [6, 10, 4],
    "qwen2_5_vl": [6, 10, 4],
    "qwen3_vl": [4, 10, 4],
    "gemma3": [4, 4, 4],
    "smolvlm": [20, 12, 20],
    "idefics3": [20, 12, 20],
    "llava": [16, 16, 16],
    "mistral3": [6, 8, 4],
}


def test_logits_are_mlx_vlms_own(family_dir, pictures):
    """A padded batch of rows with images of three sizes: each row's logits are those of
    mlx-vlm's forward of that row alone."""
    model = load_vision_model(family_dir, config_of(family_dir), "float32")
    tokens, rows, files = two_rows(model, pictures, family_dir)
    counts = IMAGE_COUNTS[model.family.name]
    assert [model.image_tokens.counts([p], "t")[0] for p in pictures] == counts
    assert int((tokens == model.image_tokens.token_id).sum()) == sum(counts)
    ours = our_logits(model, tokens, files)
    for b, (ids, fs) in enumerate(zip(rows, files, strict=True)):
        want = np.array(mlx_vlm_logits(model, ids, fs))
        got = np.array(ours[b, : len(ids)])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_lora_gradients_are_mlx_vlms_own(family_dir, pictures):
    """LoRA on the language model: the gradients of the next-token loss through mlxtune's
    forward (features made outside, positions from the host) are those through mlx-vlm's."""
    model = load_vision_model(family_dir, config_of(family_dir), "float32")
    lm_parts(model)  # the head and embedding are found through the wrapper
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    shake_adapters(model)
    tokens, rows, files = two_rows(model, pictures, family_dir)

    def naive(m):
        total = 0.0
        for ids, fs in zip(rows, files, strict=True):
            logits = mlx_vlm_logits(m, ids[:-1], fs)
            total = total + nn.losses.cross_entropy(logits, mx.array(ids[1:])).sum()
        return total

    arrays = {k: mx.array(v) for k, v in model.batch_arrays(tokens, files).items()}
    prepared = model.prepare(arrays)
    real = np.zeros(tokens.shape, bool)
    for b, ids in enumerate(rows):
        real[b, 1 : len(ids)] = True

    def ours(m):
        with images(step_images(prepared, -1)):
            logits = m(mx.array(tokens[:, :-1]))
        ce = nn.losses.cross_entropy(logits, mx.array(tokens[:, 1:]))
        return (ce * mx.array(real[:, 1:])).sum()

    _, want = nn.value_and_grad(model, naive)(model)
    _, got = nn.value_and_grad(model, ours)(model)
    want, got = dict(tree_flatten(want)), dict(tree_flatten(got))
    assert want.keys() == got.keys() and len(want) == 28  # A and B of 14 adapted layers
    for k, w in want.items():
        w = np.array(w)  # fp32 round-off: relative to the matrix's largest entry
        np.testing.assert_allclose(np.array(got[k]), w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def test_greedy_answers_to_image_prompts_are_mlx_vlms_own(family_dir, pictures):
    """Prompts of different lengths with images (left-padded in one batch, decoded in
    compiled steps from the cache, each row's rotary positions shifted as its images say;
    Gemma 3's sliding window in its own caches, prompt by prompt) give the tokens a greedy
    loop of mlx-vlm's whole forward gives, prompt by prompt."""
    model = load_vision_model(family_dir, config_of(family_dir), "float32")
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    shake_adapters(model, seed=3)
    _, rows, files = two_rows(model, pictures, family_dir)
    prompts = [rows[0][:-1], rows[1][:-2]]
    got = generate_ids(model, prompts, 6, set(), images=files)
    for prompt, fs, ours in zip(prompts, files, got, strict=True):
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(mx.argmax(mlx_vlm_logits(model, ids, fs)[-1]).item()))
        assert ours == ids[len(prompt) :]
    assert generate_ids(model, prompts, 6, set()) != got  # the images count


def encoder(folder: Path) -> Encoder:
    tok = load_tokenizer(folder)
    return Encoder(tok, images=load_image_tokens(folder, config_of(folder)))


def image_chat(path: str, answer: str = "red") -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": path}, {"type": "text", "text": "hue?"}],
            },
            {"role": "assistant", "content": answer},
        ]
    }


def test_an_image_chat_encodes_its_image_tokens_and_trains_on_the_answer(qwen_dir, tmp_path):
    """A 56 x 84 image (a 4 x 6 grid of 14-pixel patches, merged 2 x 2) is 6 image tokens in
    place of the template's one; the targets are the answer and its end of turn only."""
    Image.new("RGB", (56, 84), (200, 0, 0)).save(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "train.jsonl", [image_chat("a.png")])
    enc = encoder(qwen_dir)
    ex = enc.encode(json.loads(data.read_text()), "chat", f"{data}:1")
    tok = load_tokenizer(qwen_dir)
    pad = tok._tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text_before = "<|im_start|>user\n<|vision_start|>"
    text_after = "<|vision_end|>hue?<|im_end|>\n<|im_start|>assistant\n"
    want = tok.encode(text_before, add_special_tokens=False) + [pad] * 6
    want += tok.encode(text_after, add_special_tokens=False)
    answer = tok.encode("red<|im_end|>", add_special_tokens=False)
    assert ex.ids[: len(want)] == want
    assert ex.images == (str(tmp_path / "a.png"),)
    targets = [i for i, m in zip(ex.ids, ex.mask, strict=True) if m]
    assert targets[: len(answer)] == answer
    assert all(m == 0 for m in ex.mask[: len(want)])
    assert ex.prompt_ids == want
    assert ex.display == "[image]hue?"


def test_an_images_column_fills_the_chats_image_parts(qwen_dir, tmp_path):
    for name in ("a.png", "b.png"):
        Image.new("RGB", (56, 56), (0, 0, 200)).save(tmp_path / name)
    enc = encoder(qwen_dir)
    where = f"{write_jsonl(tmp_path / 'd.jsonl', [{}])}:1"
    named = image_chat("a.png")
    bare = {"images": ["a.png"], "messages": json.loads(json.dumps(named["messages"]))}
    del bare["messages"][0]["content"][0]["image"]
    plain = {  # a string content and a column: the images open the first user turn
        "images": ["a.png"],
        "messages": [
            {"role": "user", "content": "hue?"},
            {"role": "assistant", "content": "red"},
        ],
    }
    a, b, c = (enc.encode(r, "chat", where) for r in (named, bare, plain))
    assert a.ids == b.ids == c.ids and a.mask == b.mask == c.mask
    for row, message in [
        (
            {**bare, "images": ["a.png", "b.png"]},
            r"shows 1 image\(s\) and the .images. column names 2",
        ),
        ({**named, "images": ["b.png"]}, "not both"),
        ({"messages": bare["messages"]}, "names no file"),
    ]:
        with pytest.raises(UserInputError, match=message) as e:
            enc.encode(row, "chat", where)
        assert e.value.where == where


def test_a_missing_or_unreadable_image_is_a_bad_row_naming_it(qwen_dir, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    data = write_jsonl(tmp_path / "d.jsonl", [image_chat("gone.png"), image_chat("broken.png")])
    enc = encoder(qwen_dir)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    with pytest.raises(UserInputError, match="image not found") as e:
        enc.encode(rows[0], "chat", f"{data}:1")
    assert str(tmp_path / "gone.png") in e.value.message and e.value.where == f"{data}:1"
    with pytest.raises(UserInputError, match="cannot read the image") as e:
        enc.encode(rows[1], "chat", f"{data}:2")
    assert str(tmp_path / "broken.png") in e.value.message and e.value.where == f"{data}:2"


def processor_text(family: str) -> tuple[str, str]:
    """(what the family's chat template writes for an image, the text its processor puts
    there) for an 84 x 56 picture, from the processors' own formulas: Gemma 3 frames its 4
    soft tokens with newlines; SmolVLM's picture goes to 112 x 75, two rows and two columns
    of 56-pixel tiles, each tile's 4 tokens after its tag, then the whole picture's; Mistral
    3's (56 x 84) is 2 rows of 3 tokens, each row ended by a break, the last by the end."""
    if family == "mistral3":
        return "[IMG]", "[IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_END]"
    if family == "gemma3":
        soft = "<image_soft_token>" * 4
        return "<start_of_image>", f"\n\n<start_of_image>{soft}<end_of_image>\n\n"
    tiles, fake = "<image>" * 4, "<fake_token_around_image>"
    grid = "".join(
        "".join(f"{fake}<row_{r}_col_{c}>{tiles}" for c in (1, 2)) + "\n" for r in (1, 2)
    )
    return "<image>", f"{grid}\n{fake}<global-img>{tiles}{fake}"


@pytest.mark.parametrize("family", ["gemma3", "smolvlm", "mistral3"])
def test_an_image_chat_encodes_as_the_familys_processor_writes_it(family, tmp_path):
    """The example's ids are the chat's rendering with the image's marker replaced by the
    processor's text, tokenized whole: Gemma 3's newlines join the template's into one
    token. Only the answer (and what follows it in its turn) is a target."""
    folder = build_vision_dir(tmp_path / "model", family)
    Image.new("RGB", (84, 56), (200, 0, 0)).save(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "d.jsonl", [image_chat("a.png")])
    ex = encoder(folder).encode(json.loads(data.read_text()), "chat", f"{data}:1")
    hf = load_tokenizer(folder)._tokenizer
    text = hf.apply_chat_template(image_chat("a.png")["messages"], tokenize=False)
    marker, expansion = processor_text(family)
    assert text.count(marker) == 1
    want = hf.backend_tokenizer.encode(text.replace(marker, expansion), add_special_tokens=False)
    assert ex.ids == want.ids
    if family == "gemma3":  # "user\n" and the expansion's "\n\n": one three-newline token
        assert hf.convert_tokens_to_ids("\u010a\u010a\u010a") in ex.ids
    targets = [i for i, m in zip(ex.ids, ex.mask, strict=True) if m]
    first = ex.mask.index(1)
    assert hf.decode(targets).lstrip().startswith("red") and all(ex.mask[first:])
    assert hf.decode(ex.ids[:first]).endswith(("<start_of_turn>model\n", "Assistant:", "[/INST]"))


def test_a_text_model_refuses_a_row_with_images(qwen_dir, tmp_path):
    Image.new("RGB", (56, 56)).save(tmp_path / "a.png")
    enc = Encoder(load_tokenizer(qwen_dir))
    with pytest.raises(UserInputError, match="no vision-language model"):
        enc.encode(image_chat("a.png"), "chat", f"{tmp_path / 'd.jsonl'}:1")


def test_a_vision_family_mlxtune_does_not_train_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "paligemma", "vision_config": {"model_type": "siglip"}})
    )
    with pytest.raises(UserInputError, match="'paligemma' is a vision-language model"):
        load_image_tokens(tmp_path, config_of(tmp_path))
    assert sorted(VISION_FAMILIES) == sorted(VISION_ARCHS)  # each family trained has a test model


@pytest.fixture(scope="module")
def colours(qwen_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("colours")
    write_jsonl(data / "train.jsonl", colour_rows(data, "train", 24))
    write_jsonl(data / "valid.jsonl", colour_rows(data, "valid", 8))
    return tiny_recipe(
        data,
        qwen_dir,
        adapter={"type": "lora", "rank": 4, "alpha": 8, "targets": ["all-linear"]},
        train={"batch_size": 8, "max_steps": 6, "log_every": 1, "progress": False, "seed": 1},
        checkpoints={"every": 2},
    )


def test_a_run_on_images_trains_and_resumes_exactly(colours, tmp_path):
    """SFT with LoRA on the colour-of-an-image task: the loss falls, only the language model
    trains, and a run that crashed after step 4 and resumed gives the whole run's rows."""
    whole = build_run(colours, tmp_path, "whole")
    whole.run()
    rows = run_rows(tmp_path / "whole")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0]
    names = [k for k, _ in tree_flatten(whole.model.trainable_parameters())]
    assert names and all(k.startswith("vlm.language_model.") for k in names)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_run(colours, tmp_path, "crash", callbacks=[make_crash(4)]).run()
    build_run(colours, tmp_path, "crash", resume="latest").run()
    same_rows(run_rows(tmp_path / "crash"), rows, rel=0, abs=0)


def test_packed_rows_with_images_give_each_examples_loss(colours, tmp_path):
    """Examples packed into one row keep their images (the row's images are its examples',
    in order) and their rotary positions run on: the packed loss is the examples' summed
    loss."""
    r = json.loads(json.dumps(colours))
    r["data"].update(packing="pack", pack_length=96)
    tr = build_run(r, tmp_path)
    exs = tr.train_set.examples[:4]
    assert all(e.images for e in exs)
    packed = make_packed_batch([exs[:2], exs[2:]], tr.pad_id, 96)
    assert packed.images == (exs[0].images + exs[1].images, exs[2].images + exs[3].images)
    with kernel_attention(tr.model, "chunked"):
        loss_p, n_p, _ = tr.objective.loss(tr.model, tr.engine.arrays(packed))
        alone = make_batch(exs, tr.pad_id, 8)
        loss_u, n_u, _ = tr.objective.loss(tr.model, tr.engine.arrays(alone))
    assert n_p.item() == n_u.item() == sum(e.n_targets for e in exs)
    assert loss_p.item() == pytest.approx(loss_u.item(), rel=1e-5)


def test_the_mlx_vlm_export_loads_in_mlx_vlm_with_the_trained_logits(colours, qwen_dir, tmp_path):
    """The adapters exported as mlx-vlm's, loaded by mlx_vlm.load over the base, give the
    trained model's logits on an image prompt (mlx-vlm's own LoRA layers and forward)."""
    from mlx_vlm import load as mlx_vlm_load

    r = json.loads(json.dumps(colours))
    r["adapter"]["type"] = "dora"
    build_run(r, tmp_path).run()
    done = load_checkpoint(tmp_path / "run" / "checkpoints" / "final")
    trained, out = done.model, tmp_path / "vlm"
    out.mkdir()
    export(done, "mlx-vlm", out)
    theirs, _ = mlx_vlm_load(str(qwen_dir), adapter_path=str(out))
    pictures = sorted((Path(r["data"]["train"]).parent / "img").glob("*.png"))[:3]
    tokens, rows, files = two_rows(trained, pictures, qwen_dir)
    ours = our_logits(trained, tokens, files)
    shown = {"vlm": theirs, "image_tokens": trained.image_tokens}
    for b, (ids, fs) in enumerate(zip(rows, files, strict=True)):
        want = np.array(mlx_vlm_logits(SimpleNamespace(**shown), ids, fs))
        np.testing.assert_allclose(np.array(ours[b, : len(ids)]), want, rtol=1e-4, atol=1e-4)
    for fmt in ("mlx-lm", "gguf", "gguf-adapter"):
        with pytest.raises(UserInputError, match="--format mlx-vlm"):
            export(done, fmt, tmp_path / fmt)


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3", "smolvlm", "llava", "mistral3"])
def test_each_family_trains_and_its_exports_load_in_mlx_vlm(family, pictures, tmp_path):
    """SFT with LoRA on image chats: the loss falls; the adapters exported as mlx-vlm's (over
    the base) and the fused model both load in mlx-vlm with the trained model's logits."""
    from mlx_vlm import load as mlx_vlm_load

    r, folder = image_run(tmp_path, family, LORA_ALL, batch_size=8)
    build_run(r, tmp_path).run()
    losses = [x["loss"] for x in run_rows(tmp_path / "run") if "loss" in x]
    assert losses[-1] < losses[0]
    done = load_checkpoint(tmp_path / "run" / "checkpoints" / "final")
    trained = done.model
    tokens, rows, files = two_rows(trained, pictures, folder)
    ours = our_logits(trained, tokens, files)
    for fmt in ("mlx-vlm", "fused"):
        out = tmp_path / fmt
        out.mkdir()
        export(done, fmt, out)
        theirs, _ = mlx_vlm_load(str(folder), adapter_path=str(out)) if fmt == "mlx-vlm" else (
            mlx_vlm_load(str(out)))  # fmt: skip
        shown = SimpleNamespace(vlm=theirs, image_tokens=trained.image_tokens)
        for b, (ids, fs) in enumerate(zip(rows, files, strict=True)):
            want = np.array(mlx_vlm_logits(shown, ids, fs))
            got = np.array(ours[b, : len(ids)])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def hf_logits(torch, hf, model, ids, files):
    """transformers' logits of one row with its pictures, through the family's processor."""
    import inspect

    if not files:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    pictures = [Image.open(f).convert("RGB") for f in files]
    it, tiles = model.image_tokens, model.family.name in ("smolvlm", "idefics3")
    out = it.processor(images=[[p] for p in pictures] if tiles else pictures, return_tensors="np")
    keys = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
    kw = {k: torch.tensor(np.asarray(out[k])) for k in keys if k in out}
    if tiles:  # one sample showing every picture (transformers drops the padding tiles)
        for k in ("pixel_values", "pixel_attention_mask"):
            kw[k] = kw[k].reshape(1, -1, *kw[k].shape[2:])
    inner = hf.get_base_model() if hasattr(hf, "get_base_model") else hf  # PEFT's wrapper
    if "mm_token_type_ids" in inspect.signature(inner.forward).parameters:  # Qwen's M-RoPE
        kw["mm_token_type_ids"] = torch.tensor([[int(i == it.token_id) for i in ids]])
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), **kw).logits[0].numpy()


@pytest.mark.parametrize("family", sorted(VISION_ARCHS))
def test_transformers_reads_the_fused_and_peft_exports(family, pictures, tmp_path):
    """The fused export loads in transformers with the trained model's logits on an image
    prompt, and the PEFT export over the base (the untrained model written as the fused export
    writes it) gives them too. Mistral 3 is compared on a text prompt: transformers' Pixtral
    tower (its 2-D rotary embedding) computes other features than mlx-vlm's, which mlxtune's
    forward follows."""
    from test_interop import interop

    torch, peft = interop("torch"), interop("peft")
    from transformers import AutoModelForImageTextToText

    r, folder = image_run(tmp_path, family, LORA_ALL, steps=2)
    r["eval"] = {"every": None}
    build_run(r, tmp_path).run()
    done = load_checkpoint(tmp_path / "run" / "checkpoints" / "final")
    trained = done.model
    for fmt in ("peft", "fused"):  # fused last: it merges the adapters in place
        (tmp_path / fmt).mkdir()
        export(done, fmt, tmp_path / fmt)
    base = load_vision_model(folder, config_of(folder), "float32")
    hf_base = tmp_path / "hf-base"  # the base as the fused export writes a model
    hf_base.mkdir()
    weights = hf_vision_weights(base, dict(tree_flatten(base.vlm.parameters())))
    mx.save_safetensors(str(hf_base / "model.safetensors"), weights, {"format": "pt"})
    (hf_base / "config.json").write_text((folder / "config.json").read_text())

    tokens, rows, files = two_rows(trained, pictures, folder)
    ids, shown = rows[1], files[1]
    ours = np.array(our_logits(trained, np.array([ids]), [shown])[0])
    if family == "mistral3":
        ids, shown = [5, 20, 21, 22, 23, 24, 6], []
        ours = np.array(trained(mx.array([ids]))[0])

    def theirs(model):
        model.eval()
        return hf_logits(torch, model, trained, ids, shown)

    fused = AutoModelForImageTextToText.from_pretrained(tmp_path / "fused", dtype=torch.float32)
    untrained = AutoModelForImageTextToText.from_pretrained(hf_base, dtype=torch.float32)
    assert np.abs(theirs(untrained) - ours).max() > 1e-3  # the adapters moved the logits
    adapted = peft.PeftModel.from_pretrained(untrained, str(tmp_path / "peft"))
    scale = np.abs(ours).max()
    for what, model in (("fused", fused), ("peft", adapted)):
        np.testing.assert_allclose(theirs(model), ours, rtol=1e-4, atol=1e-4 * scale, err_msg=what)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "smolvlm", "mistral3"])
def test_adapters_in_the_tower_and_projector_get_mlx_vlms_gradients(family, tmp_path):
    """adapter.targets naming the vision tower and the projector: the step's gradients (the
    language model's in the compiled step, the tower's from the features' gradient carried
    back through it) equal those of the summed loss through mlx-vlm's whole forward."""
    r, _ = image_run(tmp_path, family, TOWER_LORA)
    t = build_run(r, tmp_path)
    shake_adapters(t.model)
    tower = [
        k for k, _ in tree_flatten(t.model.trainable_parameters()) if ".language_model." not in k
    ]
    parts = {k.split(".")[1] for k in tower}
    assert tower and parts == set(t.model.tower_names)  # tower and projector both adapted
    batch = next(t.objective.batches())[1]
    _, _, _, got = t.engine.grad_step(t.engine.arrays(batch), mx.array(1.0))

    def naive(m):  # each row alone, unpadded, its pictures through mlx-vlm's processor
        total = 0.0
        for ids, mask, n, files in zip(
            batch.tokens.tolist(), batch.mask.tolist(), batch.lengths, batch.images, strict=True
        ):
            logits = mlx_vlm_logits(m, ids[: n - 1], [Path(f) for f in files])
            ce = nn.losses.cross_entropy(logits, mx.array(ids[1:n]))
            total = total + (ce * mx.array(mask[1:n])).sum()
        return total

    _, want = nn.value_and_grad(t.model, naive)(t.model)
    want, got = dict(tree_flatten(want)), dict(tree_flatten(got))
    assert want.keys() == got.keys() and any(k in want for k in tower)
    top = max(float(np.abs(np.array(w)).max()) for w in want.values())
    for k, w in want.items():
        w, g = np.array(w), np.array(got[k])
        if np.abs(w).max() < 1e-5 * top:  # next to nothing (Pixtral's keys): ours too
            assert np.abs(g).max() < 1e-4 * top, k
            continue
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * np.abs(w).max(), err_msg=k)


def test_a_run_with_adapters_in_the_tower_trains_resumes_and_exports(pictures, tmp_path):
    """Tower and projector adapters train with the language model's (the loss falls, every
    adapter moves), a crashed run resumes to the whole run's rows, and the mlx-vlm, PEFT and
    fused exports carry the tower's adapters (mlx-vlm's load gives the trained logits)."""
    from mlx_vlm import load as mlx_vlm_load

    r, folder = image_run(tmp_path, "qwen2_vl", TOWER_LORA, steps=4)
    r["checkpoints"] = {"every": 2}
    whole = build_run(r, tmp_path, "whole")
    start = {k: np.array(v) for k, v in tree_flatten(whole.model.trainable_parameters())}
    whole.run()
    rows = run_rows(tmp_path / "whole")
    losses = [x["loss"] for x in rows if "loss" in x]
    assert losses[-1] < losses[0]
    end = dict(tree_flatten(whole.model.trainable_parameters()))
    assert all(not np.array_equal(np.array(end[k]), v) for k, v in start.items())
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_run(r, tmp_path, "crash", callbacks=[make_crash(2)]).run()
    build_run(r, tmp_path, "crash", resume="latest").run()
    same_rows(run_rows(tmp_path / "crash"), rows, rel=0, abs=0)

    done = load_checkpoint(tmp_path / "whole" / "checkpoints" / "final")
    for fmt in ("mlx-vlm", "peft"):
        (tmp_path / fmt).mkdir()
        export(done, fmt, tmp_path / fmt)
    peft = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert any(m.startswith("model.visual.blocks.") for m in peft["target_modules"])
    assert any(m.startswith("model.visual.merger.") for m in peft["target_modules"])
    theirs, _ = mlx_vlm_load(str(folder), adapter_path=str(tmp_path / "mlx-vlm"))
    tokens, rows2, files = two_rows(done.model, pictures, folder)
    ours = our_logits(done.model, tokens, files)
    shown = SimpleNamespace(vlm=theirs, image_tokens=done.model.image_tokens)
    for b, (ids, fs) in enumerate(zip(rows2, files, strict=True)):
        want = np.array(mlx_vlm_logits(shown, ids, fs))
        np.testing.assert_allclose(np.array(ours[b, : len(ids)]), want, rtol=1e-4, atol=1e-4)


def test_tower_targets_a_model_cannot_take_are_refused_at_adapter_targets(tmp_path):
    """Gemma 3's projector multiplies its weight directly (no linear layer to adapt); a text
    model has no vision tower."""
    adapter = {**TOWER_LORA, "targets": ["q_proj", "projector"]}
    r, _ = image_run(tmp_path, "gemma3", adapter)
    with pytest.raises(UserInputError, match="gemma3 model's projector has no linear layer") as e:
        build_run(r, tmp_path).run()
    assert e.value.where == "adapter.targets"


def test_dpo_with_adapters_in_the_tower_takes_a_precomputed_reference(qwen_dir, tmp_path):
    """The step's image features are the policy's: a reference computed in the step would
    read them, so DPO with tower adapters is refused unless its reference is precomputed
    (read once before training, the adapters still zero), which then trains."""
    write_jsonl(tmp_path / "pairs.jsonl", colour_pairs(tmp_path, 12))
    r = tiny_recipe(
        tmp_path,
        qwen_dir,
        data={"train": str(tmp_path / "pairs.jsonl"), "max_length": 64, "valid_fraction": 0.25},
        objective={"type": "dpo"},
        adapter=TOWER_LORA,
        train={"batch_size": 4, "max_steps": 2, "log_every": 1, "progress": False},
    )
    with pytest.raises(UserInputError, match="objective.reference: precomputed") as e:
        build_run(r, tmp_path, "live").run()
    assert e.value.where == "adapter.targets"
    r["objective"]["reference"] = "precomputed"
    build_run(r, tmp_path).run()
    losses = [x["loss"] for x in run_rows(tmp_path / "run") if "loss" in x]
    assert len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.parametrize("targets", [["all-linear"], ["all-linear", "vision"]],
                         ids=["frozen-tower", "tower-adapters"])  # fmt: skip
def test_the_memory_plan_counts_the_towers_pass(targets, tmp_path):
    """A tower far wider than its language model, on 224-pixel pictures: the plan holds the
    measured peak of a step (the tower's pass before it, its backward after it where its
    adapters train) within the bounds it holds for text, and would not without the tower."""
    wide = {"embed_dim": 256, "num_heads": 4, "depth": 4}
    folder = build_vision_dir(
        tmp_path / "model", "qwen2_vl", vision=wide, processor={"max_pixels": 224 * 224}
    )
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    rows = []
    for i in range(8):
        Image.new("RGB", (224, 224), (40 * i, 90, 160)).save(data / "img" / f"{i}.png")
        rows.append(image_chat(f"img/{i}.png"))
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "valid.jsonl", rows[:2])
    r = tiny_recipe(
        data,
        folder,
        adapter={"type": "lora", "rank": 4, "alpha": 8, "targets": targets},
        train={"batch_size": 4, "max_steps": 2, "progress": False},
        eval={"every": None},
    )
    r["data"]["max_length"] = 128
    t = build_run(r, tmp_path)
    shape = shape_of(t)
    planned = estimate(shape)
    assert planned["tower"] > 0
    peak = measured_peak(t)
    assert 0.6 < planned["total"] / peak < 1.6, (planned, peak)
    without = estimate(replace(shape, tower_row_bytes=0.0))["total"]
    assert without / peak < 0.6, (without, peak)  # the tower's pass is what sets the peak


def test_a_checkpoint_mlx_vlm_quantized_trains(tmp_path):
    """A model folder mlx-vlm's own convert quantized to 4 bits (as the quantized checkpoints
    people download are) loads as it is and trains LoRA adapters, its loss falling."""
    from mlx_vlm import convert

    dense = build_vision_dir(tmp_path / "dense", "qwen2_vl")
    convert(str(dense), mlx_path=str(tmp_path / "q4"), quantize=True, q_group_size=32)
    assert "quantization" in config_of(tmp_path / "q4")
    r, _ = image_run(tmp_path, "qwen2_vl", LORA_ALL)
    r["model"]["path"] = str(tmp_path / "q4")
    t = build_run(r, tmp_path)
    t.run()
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in t.model.named_modules())
    losses = [x["loss"] for x in run_rows(tmp_path / "run") if "loss" in x]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_orpo_and_cpo_runs_train_on_image_pairs(kind, qwen_dir, tmp_path):
    """ORPO and CPO read image pairs as DPO does (tested against mlx-vlm's forward above):
    a run goes through and its loss falls."""
    write_jsonl(tmp_path / "pairs.jsonl", colour_pairs(tmp_path, 16))
    r = tiny_recipe(
        tmp_path,
        qwen_dir,
        data={"train": str(tmp_path / "pairs.jsonl"), "max_length": 64, "valid_fraction": 0.25},
        objective={"type": kind},
        adapter={"type": "lora", "rank": 4, "alpha": 8, "targets": ["all-linear"]},
        train={"batch_size": 4, "max_steps": 6, "log_every": 1, "progress": False},
    )
    build_run(r, tmp_path).run()
    losses = [x["loss"] for x in run_rows(tmp_path / "run") if "loss" in x]
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.parametrize(
    "key, value",
    [
        ("objective", {"type": "reward"}),
        ("data", {"packing": "stream"}),
    ],
)
def test_what_vision_models_do_not_train_with_is_refused_at_its_key(colours, tmp_path, key, value):
    r = json.loads(json.dumps(colours))
    r[key] = {**r.get(key, {}), **value}
    if key == "objective":  # preference pairs, so that the data reads and the model loads
        pairs = [{"prompt": "hue?", "chosen": "red", "rejected": "blue"}] * 8
        r["data"]["train"] = str(write_jsonl(tmp_path / "pairs.jsonl", pairs))
        r["data"]["valid"] = r["data"]["train"]
    where = {"objective": "objective.type", "data": "data.packing"}.get(key, f"{key}.")
    with pytest.raises(UserInputError) as e:
        build_run(r, tmp_path).run()
    assert e.value.where.startswith(where), e.value


def test_eval_compares_the_trained_model_with_its_base_on_image_prompts(colours, tmp_path):
    """``mlxtune eval RUN --base`` reads the run's image data for both models: the trained one's
    validation loss is the run's own final evaluation, and its greedy answers are those the
    run's exact match gave."""
    r = json.loads(json.dumps(colours))
    r["eval"] = {"every": 6, "exact_match": 4}
    build_run(r, tmp_path).run()
    rows = run_rows(tmp_path / "run")
    out = evaluate_run(tmp_path / "run", base=True)
    trained, base = out["models"]["trained"], out["models"]["base"]
    last = [x for x in rows if "eval_loss" in x][-1]
    assert trained["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert base["eval_loss"] > trained["eval_loss"]
    assert trained["exact_match_examples"] == 4 and len(out["answers"]) == 3
    before = next(x["exact_match_before"] for x in rows if "exact_match_before" in x)
    after = next(x["exact_match_after"] for x in rows if "exact_match_after" in x)
    assert (base["exact_match"], trained["exact_match"]) == (before, after)


REPO = Path(__file__).resolve().parent.parent


def quickstart(tmp_path, *overrides):
    from mlxtune import Trainer, load_recipe
    from mlxtune.console import Console

    r = load_recipe(REPO / "recipes" / "quickstart-vision.yaml", list(overrides))
    tr = Trainer(r, run_dir=tmp_path / "run", console=Console(quiet=True))
    summary = tr.run()
    return summary, [row for row in tr.run_dir.read_jsonl("metrics.jsonl") if "loss" in row]


def test_the_vision_quickstart_builds_its_base_learns_and_exports_for_mlx_vlm(tmp_path):
    """A short cut of recipes/quickstart-vision.yaml: the model built from model.arch is
    written as the run's base, the loss falls, and the fused export loads in mlx-vlm with the
    trained model's logits on image prompts."""
    from mlx_vlm import load as mlx_vlm_load

    summary, rows = quickstart(
        tmp_path, "train.max_steps=40", "eval.exact_match=0", "eval.every=null",
        "samples.every=null",
    )  # fmt: skip
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    run = tmp_path / "run"
    assert (run / "base" / "model.safetensors").exists()
    trained = load_checkpoint(run / "checkpoints" / "final").model
    theirs, _ = mlx_vlm_load(str(run / "export" / "fused"))
    pictures = sorted((REPO / "recipes" / "data" / "colours" / "img").glob("test-*.png"))[:3]
    tokens, rows, files = two_rows(trained, pictures, run / "base")
    ours = our_logits(trained, tokens, files)
    shown = SimpleNamespace(vlm=theirs, image_tokens=trained.image_tokens)
    for b, (ids, fs) in enumerate(zip(rows, files, strict=True)):
        want = np.array(mlx_vlm_logits(shown, ids, fs))
        np.testing.assert_allclose(np.array(ours[b, : len(ids)]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_vision_quickstart_reaches_its_targets(tmp_path):
    summary, rows = quickstart(tmp_path)
    assert summary["exact_match_before"] <= 0.05 and summary["exact_match_after"] >= 0.9
    assert summary["train_time_s"] < 120


def test_gradient_checkpointing_and_a_quantized_base_train_image_chats(colours, tmp_path):
    """Checkpointed blocks give the run's rows (the blocks recompute what they gave); a 4-bit
    base (QLoRA: the tower too) trains, its loss falling."""
    rows = run_rows(run_of(colours, tmp_path, "plain"))
    r = json.loads(json.dumps(colours))
    r["train"]["grad_checkpointing"] = True
    same_rows(run_rows(run_of(r, tmp_path, "checkpointed")), rows, rel=1e-4, abs=1e-6)
    r = json.loads(json.dumps(colours))
    r["model"]["quantize"] = {"bits": 4, "group_size": 32}
    tr = build_run(r, tmp_path, "qlora")
    tr.run()
    quantized = [n for n, m in tr.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(".language_model." in n for n in quantized)
    assert any(".vision_tower." in n for n in quantized)
    losses = [x["loss"] for x in run_rows(tmp_path / "qlora") if "loss" in x]
    assert losses[-1] < losses[0]


def run_of(r, tmp_path, name):
    build_run(r, tmp_path, name).run()
    return tmp_path / name


@pytest.mark.slow  # two processes: about a minute
def test_two_processes_train_image_chats_as_one(colours, tmp_path):
    from test_distributed import one_and_two

    r = json.loads(json.dumps(colours))
    r["eval"] = {"every": 3}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    same_rows(run_rows(one), run_rows(two), rel=1e-5, abs=1e-6)


def test_batches_whose_images_take_different_token_counts_reach_the_step_in_one_shape(
    qwen_dir, pictures
):
    """The step's image features are padded to a multiple of FEATURE_ROWS rows (no token
    reads the padding): a 6-token image and a 10-token one compile one step, not two."""
    model = load_vision_model(qwen_dir, config_of(qwen_dir), "float32")
    it, shapes = model.image_tokens, set()
    for p in pictures[:2]:
        ids = [257, 259, it.token_id, 260, 10]
        ids = it.expand(ids, [0] * 5, it.layouts([p], "t"), load_tokenizer(qwen_dir), "t")[0]
        arrays = model.batch_arrays(np.array([ids]), [[p]])
        shapes.add(model.prepare({k: mx.array(v) for k, v in arrays.items()})["features"].shape)
    assert len(shapes) == 1 and next(iter(shapes))[0] % FEATURE_ROWS == 0


def colour_pairs(folder: Path, n: int) -> list[dict]:
    """Preference rows over the colour chats: the right colour chosen, another rejected, the
    image in an ``images`` column beside the prompt's bare image part."""
    out = []
    for i, row in enumerate(colour_rows(folder, "pairs", n)):
        question = json.loads(json.dumps(row["messages"][0]))
        path = question["content"][0].pop("image")
        right = row["messages"][1]["content"]
        wrong = sorted(c for c in COLOURS if c != right)[i % 2]
        out.append(
            {
                "images": [path],
                "prompt": [question],
                "chosen": [{"role": "assistant", "content": right}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return out


def test_dpo_on_image_pairs_is_its_formula_from_mlx_vlms_own_forward(qwen_dir, tmp_path):
    """A DPO batch of pairs sharing their prompt's image: the loss is the DPO formula of the
    completions' log-probabilities under the policy and under the base (the adapters off),
    each from mlx-vlm's whole forward of that sequence with its image."""
    from test_preference import dpo_formula

    from mlxtune.adapters import adapters_disabled

    write_jsonl(tmp_path / "pairs.jsonl", colour_pairs(tmp_path, 12))
    r = tiny_recipe(
        tmp_path,
        qwen_dir,
        data={"train": str(tmp_path / "pairs.jsonl"), "max_length": 64, "valid_fraction": 0.25},
        objective={"type": "dpo", "beta": 0.5},
        adapter={"type": "lora", "rank": 4, "alpha": 8, "targets": ["all-linear"]},
        train={"batch_size": 4, "max_steps": 2, "progress": False},
    )
    t = build_run(r, tmp_path)
    shake_adapters(t.model)
    batch = next(t.objective.batches())[1]
    assert batch.images is not None and len(batch.images) == 2 * len(batch.pairs)
    pairs = [t.train_set.examples[i] for i in batch.pairs if i >= 0]

    def logp(model, ids, mask, files):
        z = np.array(mlx_vlm_logits(model, ids[:-1], [Path(f) for f in files]), np.float64)
        z -= z.max(-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return sum(lp[j, ids[j + 1]] for j in range(len(ids) - 1) if mask[j + 1])

    def both(p):
        return (logp(t.model, p.ids, p.mask, p.images),
                logp(t.model, p.rejected_ids, p.rejected_mask, p.images))  # fmt: skip

    pol = [both(p) for p in pairs]
    with adapters_disabled(t.model):
        ref = [both(p) for p in pairs]
    want = [
        dpo_formula("sigmoid", 0.5, 0.0, *pp, *rr, p.n_targets, p.rejected_targets)
        for pp, rr, p in zip(pol, ref, pairs, strict=True)
    ]
    with kernel_attention(t.model, "chunked"):
        loss, count, _ = t.objective.loss(t.model, t.engine.arrays(batch))
    assert count.item() == len(pairs)
    assert loss.item() == pytest.approx(sum(want), rel=1e-4, abs=1e-5)
    t.run()  # and a DPO run on image pairs goes through, its reference reading the images too
    rows = [x for x in run_rows(tmp_path / "run") if "loss" in x]
    assert rows and all(np.isfinite(x["loss"]) for x in rows)
