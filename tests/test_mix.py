"""procpipe.Mix: weighted mixtures of indexed sources (tf.data's sample_from_datasets)."""
from __future__ import annotations

import numpy as np
import pytest

from procpipe import Loader, Mix

SIZES = [300, 500, 200]


def _sources(sizes=SIZES) -> list[np.ndarray]:
    """Source k holds the values k * 10000 + i, so a value names its source and record."""
    return [np.arange(n) + 10000 * k for k, n in enumerate(sizes)]


def _values(loader: Loader) -> list[int]:
    return [int(v) for batch in loader for v in np.atleast_1d(batch)]


def test_mix_proportions_follow_the_weights():
    """Until the first source runs out, each element comes from source k with probability
    weights[k]: the counts of a fixed-seed draw lie within 4 standard deviations."""
    sizes, weights = [4000, 4000, 4000], [0.5, 0.3, 0.2]
    mix = Mix(_sources(sizes), weights, stop_on_empty=True)
    with Loader(mix, batch_size=100, workers=0, shuffle=True, seed=11) as loader:
        values = _values(loader)
    n = 6000
    head = np.array(values[:n]) // 10000
    for k, w in enumerate(weights):
        count = int(np.count_nonzero(head == k))
        assert abs(count - n * w) < 4 * np.sqrt(n * w * (1 - w)), (k, count)
    # stop_on_empty: the epoch ends when the first source (here the heaviest) has given all its elements
    sources = np.array(values) // 10000
    assert np.count_nonzero(sources == 0) == 4000 and len(values) < sum(sizes)
    assert values[-1] // 10000 == 0


def test_mix_every_element_once_and_same_stream_whatever_the_workers():
    mix = Mix(_sources(), [0.2, 0.2, 0.6])
    runs = []
    for workers in (0, 2):
        with Loader(mix, batch_size=16, workers=workers, shuffle=True, seed=3, epochs=2) as loader:
            runs.append(_values(loader))
    assert runs[0] == runs[1]  # the same stream with 0 or 2 workers
    total = sum(SIZES)
    epoch0, epoch1 = runs[0][:total], runs[0][total:]
    everything = sorted(int(v) for s in _sources() for v in s)
    assert sorted(epoch0) == everything and sorted(epoch1) == everything  # every element once per epoch
    assert epoch0 != epoch1  # a new draw each epoch
    # early on the heavy source dominates; the light ones fill the end once it is empty
    assert np.mean(np.array(epoch0[:200]) // 10000 == 2) > 0.45


def test_mix_resume_mid_epoch_and_weights_schedule():
    schedule = [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]
    kwargs = dict(batch_size=10, workers=0, shuffle=True, seed=5)
    with Loader(Mix(_sources(), lambda e: schedule[e % 2]), **kwargs) as loader:
        whole = [b.tolist() for b in loader]
    with Loader(Mix(_sources(), lambda e: schedule[e % 2]), **kwargs) as loader:
        it = iter(loader)
        head = [next(it).tolist() for _ in range(7)]
        state = loader.state_dict()
    assert state["mix"]["weights"] == pytest.approx(schedule[0])  # said in the state
    # resumed with other weights: the saved epoch keeps its own, the next epoch takes the new ones
    with Loader(Mix(_sources(), [1, 1, 1]), **kwargs) as loader:
        loader.load_state_dict(state)
        tail = [b.tolist() for b in loader]
        following = loader.state_dict()
    assert head + tail == whole
    assert following["epoch"] == 1 and following["mix"]["weights"] == pytest.approx([1 / 3] * 3)
    with Loader(Mix(_sources([300, 500, 201]), [1, 1, 1]), **kwargs) as loader, \
            pytest.raises(ValueError, match="lengths"):
        loader.load_state_dict(state)
    with Loader(np.arange(1000), **kwargs) as loader, pytest.raises(ValueError, match="procpipe.Mix"):
        loader.load_state_dict(state)


def test_mix_sharded_ranks_and_nested_mixtures():
    inner = Mix(_sources([50, 70]), [0.9, 0.1])
    mix = Mix([inner, np.arange(40) + 50000], [0.5, 0.5])
    assert len(mix) == 160 and mix[0] == 0 and mix[50] == 10000 and mix[120] == 50000
    seen = []
    for rank in range(2):
        with Loader(mix, batch_size=8, workers=0, shuffle=True, seed=1, shard=(rank, 2)) as loader:
            seen += _values(loader)
    assert sorted(seen) == sorted([int(mix[i]) for i in range(160)])  # 160 = 2 * 80: no padding needed


def test_mix_bad_arguments():
    with pytest.raises(ValueError, match="3 finite numbers >= 0"):
        Mix(_sources(), [1, 2])
    with pytest.raises(ValueError, match="not all 0"):
        Mix(_sources(), [0, 0, 0])
    with pytest.raises(ValueError, match="for epoch 1"):
        list(Loader(Mix(_sources(), lambda e: [1, 1, -1] if e else [1, 1, 1]), batch_size=10, workers=0, epochs=2))
    with pytest.raises(TypeError, match="not an indexed dataset"):
        Mix([np.arange(3), 5], [1, 1])
    with pytest.raises(TypeError, match="stop_on_empty must be True or False"):
        Mix(_sources(), [1, 1, 1], stop_on_empty=1)
