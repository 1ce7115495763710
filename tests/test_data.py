"""Bundled data and batch iterators."""

import itertools

import numpy as np
import pytest

import ddl_jax as ddl


def test_digits_split_is_normalised_and_stratified():
    train, test = ddl.data.digits(test_fraction=0.25)
    assert train["image"].shape[1:] == (64,) and train["image"].dtype == np.float32
    assert len(train["label"]) + len(test["label"]) == 1797
    assert abs(len(test["label"]) / 1797 - 0.25) < 0.01
    assert train["image"].min() == 0.0 and train["image"].max() == 1.0
    counts = np.bincount(test["label"], minlength=10)
    assert counts.min() >= 40 and counts.max() <= 50  # every class held out in proportion
    images, _ = ddl.data.digits(flatten=False)
    assert images["image"].shape[1:] == (8, 8, 1)


def test_batches_cover_each_epoch_once_and_reshuffle():
    data = {"x": np.arange(10), "y": -np.arange(10)}
    batches = list(ddl.data.batches(data, 3, epochs=2))
    assert len(batches) == 6 and all(b["x"].shape == (3,) for b in batches)
    assert all(np.array_equal(b["y"], -b["x"]) for b in batches)  # rows stay aligned
    first, second = (np.concatenate([b["x"] for b in batches[i : i + 3]]) for i in (0, 3))
    assert len(set(first)) == 9 and len(set(second)) == 9
    assert not np.array_equal(first, second)


def test_batches_repeat_forever_by_default():
    data = {"x": np.arange(4)}
    assert len(list(itertools.islice(ddl.data.batches(data, 4), 10))) == 10


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size must be an int in"):
        ddl.data.batches({"x": np.arange(4)}, 5)
    with pytest.raises(ValueError, match="disagree on the number of examples"):
        ddl.data.batches({"x": np.arange(4), "y": np.arange(3)}, 2)
    with pytest.raises(ValueError, match="test_fraction must be in"):
        ddl.data.digits(test_fraction=1.5)
