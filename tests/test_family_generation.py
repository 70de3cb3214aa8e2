"""Generation for families whose caches are not plain KV caches (sliding windows, conv or SSM
state): the model's own caches, checked against the fixed-capacity path on a family where both
run, and against greedy decoding by whole forward passes (no cache at all) where only the own
caches can."""

import mlx.core as mx
import numpy as np
import pytest

from mlxtune.generate import (
    Sampling,
    _decode,
    _decode_own_caches,
    generate_ids,
    plain_kv_caches,
    row_keys,
)
from mlxtune.models import build_model

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
ARCHS = {
    "llama": dict(SMALL, model_type="llama", intermediate_size=64, rms_norm_eps=1e-5),
    # a window of 4 over prompts and completions longer than it
    "gemma3_text": dict(
        SMALL,
        model_type="gemma3_text",
        intermediate_size=64,
        head_dim=8,
        sliding_window=4,
        sliding_window_pattern=2,
        query_pre_attn_scalar=8,
    ),
    "lfm2": dict(
        SMALL,
        model_type="lfm2",
        max_position_embeddings=256,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        intermediate_size=64,
        layer_types=["conv", "full_attention"],
    ),
}
PROMPTS = [[1, 5, 9, 12, 7], [3, 4], [8, 2, 6, 6, 1], [9]]


def model_of(name, scale=1.0):
    model, _ = build_model(ARCHS[name], 40, seed=4)
    # larger embeddings than the init's, so greedy continuations differ between prompts
    emb = model.model.embed_tokens
    emb.weight = emb.weight * scale
    return model


def greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt) :]


def test_the_own_caches_decode_what_the_fixed_capacity_caches_decode():
    model = model_of("llama")
    assert plain_kv_caches(model)
    s = Sampling(temperature=1.0, top_p=0.9)
    keys = row_keys(7, len(PROMPTS), 3)
    fixed = _decode(model, PROMPTS, 9, set(), s, 3, keys)
    own = _decode_own_caches(model, PROMPTS, 9, set(), s, 3, keys)
    assert own == fixed and len(fixed) == 12 and all(len(r) == 9 for r in fixed)
    assert len({tuple(r) for r in fixed}) > 4  # sampled rows differ


@pytest.mark.parametrize("name", ["gemma3_text", "lfm2"])
def test_families_with_other_caches_generate_as_whole_forward_passes_do(name):
    model = model_of(name, 1.0 if name == "gemma3_text" else 40.0)
    assert not plain_kv_caches(model)
    got = generate_ids(model, PROMPTS, 8, set())
    want = [greedy_without_cache(model, p, 8) for p in PROMPTS]
    assert got == want
    assert len({tuple(r) for r in want}) > 1
    # an end-of-sequence token stops a row there, the others go on
    stop = want[0][3]
    cut = generate_ids(model, PROMPTS, 8, {stop})
    for c, w in zip(cut, want, strict=True):
        assert c == (w[: w.index(stop)] if stop in w else w)


def test_sampled_rows_in_the_own_caches_are_each_rows_own():
    model = model_of("lfm2")
    s = Sampling(temperature=1.0)
    together = generate_ids(model, PROMPTS, 6, set(), sampling=s, group=2, seed=3)
    for i, p in enumerate(PROMPTS):  # each prompt alone draws from its own rows' keys
        keys = row_keys(3, len(PROMPTS), 2)[2 * i : 2 * i + 2]
        alone = generate_ids(model, [p], 6, set(), sampling=s, group=2, keys=keys)
        assert alone == together[2 * i : 2 * i + 2]
    logits_seen = []
    generate_ids(model, PROMPTS[:1], 3, set(), on_logits=lambda r, z: logits_seen.append(z))
    want = model(mx.array(PROMPTS[:1]))[0, -1]
    np.testing.assert_allclose(np.array(logits_seen[0][0]), np.array(want), rtol=1e-5, atol=1e-5)
