"""jg.Dataset against ggml test-opt's dataset test (T1): shards, batches, shuffles."""

import jax
import numpy as np
import pytest

import jgraph as jg


def supervised(shard_size):
    idx = np.arange(6)
    data = (16 * idx[:, None] + np.arange(2)).astype(np.float32)  # datapoint k = [16k, 16k+1]
    labels = (256 * idx[:, None]).astype(np.float32)
    return jg.Dataset(data, labels, shard_size=shard_size)


CASES = [(s, b) for s in range(1, 7) for b in range(1, 7) if b % s == 0]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("shard,batch", CASES)
def test_batches_serve_whole_shards_in_order(shard, batch, shuffle):
    ds = supervised(shard)
    if shuffle:
        ds.shuffle(jax.random.PRNGKey(shard))
    nbatches = min(6 // batch, ds.ndata // batch)
    seen = []
    for ibatch in range(nbatches):
        data, labels = ds.batch(ibatch, batch)
        assert data.shape == (batch, 2) and labels.shape == (batch, 1)
        found = (data[:, 0] // 16).astype(int)
        if not shuffle:
            np.testing.assert_array_equal(found, ibatch * batch + np.arange(batch))
        np.testing.assert_array_equal(data[:, 1], 16 * found + 1)  # data and labels stay paired
        np.testing.assert_array_equal(labels[:, 0], 256 * found)
        for j in range(0, batch, shard):  # a shard is served as a contiguous, in-order block
            np.testing.assert_array_equal(found[j:j + shard], found[j] + np.arange(shard))
        seen += list(found)
    if not shuffle or 6 % batch == 0:
        assert sorted(seen) == list(range(nbatches * batch))
        assert len(set(seen)) == len(seen)


def test_shuffle_is_a_permutation_and_keyed():
    a = jg.Dataset(np.arange(100)).shuffle(jax.random.PRNGKey(0))
    b = jg.Dataset(np.arange(100)).shuffle(jax.random.PRNGKey(0))
    c = jg.Dataset(np.arange(100)).shuffle(jax.random.PRNGKey(1))
    assert sorted(a.permutation) == list(range(100))
    np.testing.assert_array_equal(a.permutation, b.permutation)
    assert not np.array_equal(a.permutation, c.permutation)
    assert not np.array_equal(a.permutation, np.arange(100))


def test_shuffle_prefix_keeps_the_tail():
    ds = jg.Dataset(np.arange(12), shard_size=2).shuffle(jax.random.PRNGKey(5), idata=8)
    assert sorted(ds.permutation[:4]) == [0, 1, 2, 3]
    np.testing.assert_array_equal(ds.permutation[4:], [4, 5])
    with pytest.raises(jg.JGraphError, match="multiple of the shard size"):
        ds.shuffle(jax.random.PRNGKey(0), idata=3)


def test_remainder_and_errors():
    ds = jg.Dataset(np.arange(7), shard_size=2)
    assert ds.ndata == 6 and ds.nshards == 3
    assert ds.batch(0, 4)[1] is None
    with pytest.raises(jg.JGraphError, match="out of range"):
        ds.batch(1, 4)
    with pytest.raises(jg.JGraphError, match="not a multiple of the shard size"):
        ds.batch(0, 3)
    with pytest.raises(jg.JGraphError, match="labels"):
        jg.Dataset(np.arange(4), np.arange(3))
