"""The forward context: segments() and dropout_key() nest and restore, and each thread sees
only its own values."""

import threading

import mlx.core as mx
import numpy as np

from mlxtune.models import current, dropout_key, segments


def _in_thread(fn):
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


def test_segments_nest_and_restore():
    a, b = mx.array([[1, 1, 2]]), mx.array([[1, 2, 2]])
    assert current().segment_ids is None
    with segments(a):
        assert current().segment_ids is a
        with segments(b):
            assert current().segment_ids is b
        assert current().segment_ids is a
        with segments(None):
            assert current().segment_ids is None
        assert current().segment_ids is a
    assert current().segment_ids is None


def test_another_thread_does_not_see_this_ones_segments():
    with segments(mx.array([[1, 2]])):
        assert _in_thread(lambda: current().segment_ids) is None
    seen = {}
    ready, done = threading.Event(), threading.Event()

    def other():
        with segments(mx.array([[3, 3]])):
            ready.set()
            done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert ready.wait(10)
    seen["here"] = current().segment_ids  # while the other thread holds its own
    done.set()
    t.join()
    assert seen["here"] is None


def test_dropout_key_draws_are_repeatable_and_restore():
    key = mx.random.key(5)

    def draws(n):
        keys = current().dropout_keys
        return [np.array(keys.next()) for _ in range(n)]

    with dropout_key(key):
        first = draws(3)
    with dropout_key(key):
        with segments(mx.array([[1]])):
            second = draws(2)
        second.append(np.array(current().dropout_keys.next()))  # the advance outlives segments
    assert all(np.array_equal(x, y) for x, y in zip(first, second, strict=True))
    assert not np.array_equal(first[0], first[1])
    # independent reference: successive splits of the key
    k, expected = key, []
    for _ in range(3):
        k, sub = mx.random.split(k)
        expected.append(np.array(sub))
    assert all(np.array_equal(x, y) for x, y in zip(first, expected, strict=True))
    assert current().dropout_keys is None
    with dropout_key(key):
        assert _in_thread(lambda: current().dropout_keys) is None
