"""The generation engine: prompts of mixed lengths decoded together give what each gives alone;
the KV cache's logits are the full sequence's; a prompt's completions share its read and draw
what independent runs with their keys draw; sampling keeps the tokens its rules name, with the
probabilities of the softmax over them (NumPy references)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import REPO
from mlxtune.generate import Sampling, draw, filtered_logits, generate_ids, row_keys

WORDS = ["hello", "ab", "abcdefg", "zq", "mississippi", "x"]


@pytest.fixture(scope="module")
def reverse():
    from mlx_lm import load

    model, tok = load(str(REPO / "recipes" / "models" / "reverse-tiny"))
    return model, tok


def prompts(tok):
    return [list(tok.encode(f"reverse {w} =")) for w in WORDS]


class Recording(nn.Module):
    """The model, recording the rows of every call it runs in Python (a compiled step runs it
    once, while it is traced)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.seen = model, []

    @property
    def layers(self):
        return self.inner.layers

    def __call__(self, x, cache=None):
        self.seen.append(x.shape[0])
        return self.inner(x, cache=cache)


def full_greedy(model, prompt, n, eos):
    """Greedy decoding with no cache: the model over the whole sequence for every token."""
    ids, new = list(prompt), []
    for _ in range(n):
        t = int(mx.argmax(model(mx.array([ids]))[0, -1]).item())
        if t in eos:
            break
        new.append(t)
        ids.append(t)
    return new


def test_a_mixed_batch_decodes_as_each_prompt_alone(reverse):
    model, tok = reverse
    ps = prompts(tok)
    eos = {tok.eos_token_id}
    together = generate_ids(model, ps, 10, eos)
    alone = [generate_ids(model, [p], 10, eos)[0] for p in ps]
    assert together == alone
    assert tok.decode(together[0]) == "olleh"  # the model reverses words
    # and in batches of two prompts at a time
    assert generate_ids(model, ps, 10, eos, max_batch=2) == alone


def test_cached_logits_are_the_full_sequences_logits(reverse, monkeypatch):
    """Each decode step's logits (left-padded, cached; the caches grown twice, BLOCK cut to 8)
    against the model run over the whole prompt + tokens so far, without a cache; and greedy
    decoding against greedy decoding without a cache, rows leaving the batch as they end."""
    import mlxtune.generate as g

    monkeypatch.setattr(g, "BLOCK", 8)
    model, tok = reverse
    ps = prompts(tok)
    seen = []
    new = generate_ids(model, ps, 12, set(), on_logits=lambda r, z: seen.append((r, np.array(z))))
    assert len(seen) == 12 and max(len(p) for p in ps) + 12 > 16
    for step, (rows, logits) in enumerate(seen):
        assert rows == list(range(len(ps)))  # no stop: every row runs every step
        for i, p in enumerate(ps):
            full = model(mx.array([p + new[i][:step]]))[0, -1].astype(mx.float32)
            np.testing.assert_allclose(logits[i], np.array(full), rtol=1e-4, atol=1e-4)
    eos = {tok.eos_token_id}
    got = generate_ids(model, ps, 12, eos)
    assert len({len(x) for x in got}) > 2  # rows end at different steps
    assert got == [full_greedy(model, p, 12, eos) for p in ps]


def test_decode_steps_are_compiled_once_a_shape(reverse):
    """The model's Python runs for the prompt's read and once more, when the step is traced;
    a second call of the same shapes traces nothing."""
    model, tok = reverse
    rec = Recording(model)
    ps = prompts(tok)[:4]
    first = generate_ids(rec, ps, 16, set())
    assert rec.seen == [4, 4]  # the read, the trace
    again = generate_ids(rec, ps, 16, set())
    assert rec.seen == [4, 4, 4] and again == first


def test_a_group_shares_its_prompt_and_draws_what_independent_runs_draw(reverse):
    model, tok = reverse
    ps = prompts(tok)[:2]
    s = Sampling(temperature=3.0, top_k=10, top_p=0.98)
    keys = row_keys(7, len(ps), 4)
    rec = Recording(model)
    grouped = generate_ids(rec, ps, 8, {tok.eos_token_id}, sampling=s, group=4, keys=keys)
    assert rec.seen[0] == len(ps)  # each prompt read once
    one_by_one = [
        generate_ids(model, [ps[r // 4]], 8, {tok.eos_token_id}, sampling=s, keys=keys[r : r + 1])[
            0
        ]
        for r in range(8)
    ]
    assert grouped == one_by_one
    assert len({tuple(g) for g in grouped}) > 2  # the samples differ
    again = generate_ids(model, ps, 8, {tok.eos_token_id}, sampling=s, group=4, keys=keys)
    assert again == grouped  # the same keys, the same completions


def np_filtered(logits, s: Sampling):
    """Hugging Face's order: temperature, top-k, top-p (smallest set reaching p), min-p."""
    z = logits.astype(np.float64) / s.temperature
    out = np.full_like(z, -np.inf)
    for b in range(z.shape[0]):
        keep = np.ones(z.shape[1], bool)
        if s.top_k:
            keep &= z[b] >= np.sort(z[b])[-s.top_k]
        if s.top_p < 1:
            order = np.argsort(-np.where(keep, z[b], -np.inf), kind="stable")
            p = np.exp(z[b][order] - z[b][order].max()) * keep[order]
            p /= p.sum()
            mass, kept = 0.0, np.zeros_like(keep)
            for idx, pi in zip(order, p, strict=True):
                kept[idx] = keep[idx]
                mass += pi
                if mass >= s.top_p:
                    break
            keep &= kept
        if s.min_p:
            p = np.where(keep, np.exp(z[b] - z[b][keep].max()), 0)
            p /= p.sum()
            keep &= p >= s.min_p * p.max()
        out[b] = np.where(keep, z[b], -np.inf)
    return out


@pytest.mark.parametrize(
    "s",
    [
        Sampling(temperature=0.7),
        Sampling(temperature=1.3, top_k=3),
        Sampling(temperature=1.0, top_p=0.6),
        Sampling(temperature=0.9, min_p=0.2),
        Sampling(temperature=1.1, top_k=5, top_p=0.8, min_p=0.05),
    ],
    ids=["temperature", "top-k", "top-p", "min-p", "all"],
)
def test_sampling_keeps_what_its_rules_name_with_softmax_probabilities(s):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, 8)).astype(np.float32)
    want = np_filtered(logits, s)
    got = np.array(filtered_logits(mx.array(logits), s))
    assert (np.isfinite(got) == np.isfinite(want)).all()
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5)
    # draws: each row's frequencies against the softmax over what it keeps
    n = 20000
    keys = mx.random.split(mx.random.key(1), n)
    for b in range(3):
        tokens, _ = draw(mx.broadcast_to(mx.array(logits[b]), (n, 8)), keys, s)
        freq = np.bincount(np.array(tokens), minlength=8) / n
        p = np.exp(want[b] - want[b][np.isfinite(want[b])].max())
        p /= p.sum()
        np.testing.assert_allclose(freq, p, atol=0.015)
        assert (freq[~np.isfinite(want[b])] == 0).all()


def test_stop_strings_end_a_row_at_the_token_that_completes_them(reverse):
    from mlxtune.generate import StopStrings

    model, tok = reverse
    ps = prompts(tok)
    eos = {tok.eos_token_id}
    s = Sampling(temperature=1.0)
    keys = row_keys(5, len(ps), 3)
    free = generate_ids(model, ps, 12, eos, sampling=s, group=3, keys=keys)
    stop = ["s", "q"]
    cut = generate_ids(
        model, ps, 12, eos, sampling=s, group=3, keys=keys, stop=StopStrings(tok, stop)
    )
    hits = 0
    for f, c in zip(free, cut, strict=True):
        # the free completion up to the first token whose text so far holds a stop string
        ends = [j for j in range(1, len(f) + 1) if any(x in tok.decode(f[:j]) for x in stop)]
        want = f[: ends[0]] if ends else f
        hits += bool(ends)
        assert c == want
    assert hits >= 3  # some rows did stop (mississippi reversed has s; zq has q)


def test_the_drawn_tokens_log_probabilities_are_the_full_forwards(reverse):
    """logps: each drawn token's log-probability at temperature 1 (whatever the sampling's
    temperature and filters), as the model over the whole sequence gives it, EOS included where
    a row ended at it; for both decoding paths' engine (mixed prompt lengths, a group of 2)."""
    model, tok = reverse
    eos = {tok.eos_token_id}
    got: list = []
    s = Sampling(temperature=0.7, top_k=8)
    new = generate_ids(model, prompts(tok)[:4], 10, eos, sampling=s, group=2, seed=5, logps=got)
    assert len(got) == 8
    for r, (ids, lps) in enumerate(zip(new, got, strict=True)):
        ended = len(lps) == len(ids) + 1
        assert ended or len(lps) == len(ids) == 10
        seq = prompts(tok)[r // 2] + ids + ([tok.eos_token_id] if ended else [])
        z = np.array(model(mx.array([seq[:-1]]))[0].astype(mx.float32), np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        k = len(prompts(tok)[r // 2])
        want = [logp[k - 1 + j, seq[k + j]] for j in range(len(lps))]
        np.testing.assert_allclose(lps, want, atol=1e-4)
