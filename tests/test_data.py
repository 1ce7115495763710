"""Bundled data and batch iterators."""

import itertools
import pathlib
import platform
import re
import sysconfig

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


def test_batches_with_replacement_are_larger_than_the_data_and_resume():
    data = {"x": np.arange(10), "y": -np.arange(10)}
    stream = ddl.data.batches(data, 25, seed=3, replace=True)
    batches = list(itertools.islice(stream, 4))
    assert all(b["x"].shape == (25,) and np.array_equal(b["y"], -b["x"]) for b in batches)
    for step, b in enumerate(batches):  # batch s: 25 draws with replacement from (seed, s)
        np.testing.assert_array_equal(b["x"], np.random.default_rng((3, step)).integers(0, 10, 25))
    assert not np.array_equal(batches[0]["x"], batches[1]["x"])
    resumed = ddl.data.batches(data, 25, seed=3, start=2, replace=True, rows=slice(5, 10))
    for a, b in zip(batches[2:], resumed, strict=False):
        np.testing.assert_array_equal(a["x"][5:10], b["x"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size=5 is more than the 4 examples; draw with"):
        ddl.data.batches({"x": np.arange(4)}, 5)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        ddl.data.batches({"x": np.arange(4)}, 0)
    with pytest.raises(ValueError, match="with replace=True the stream is endless"):
        ddl.data.batches({"x": np.arange(4)}, 5, epochs=1, replace=True)
    with pytest.raises(ValueError, match="disagree on the number of examples"):
        ddl.data.batches({"x": np.arange(4), "y": np.arange(3)}, 2)
    with pytest.raises(ValueError, match="test_fraction must be a finite real number > 0 and < 1"):
        ddl.data.digits(test_fraction=1.5)
    with pytest.raises(ValueError, match="epochs \\(or None\\) must be an int >= 0, got 1.0"):
        ddl.data.batches({"x": np.arange(4)}, 2, epochs=1.0)


def test_numpy_scalars_are_arguments_like_python_numbers():
    data = {"x": np.arange(10)}
    numpy_args = ddl.data.batches(
        data, np.int64(3), seed=np.int32(1), epochs=np.int64(2), start=np.int32(1)
    )
    python_args = ddl.data.batches(data, 3, seed=1, epochs=2, start=1)
    for a, b in itertools.zip_longest(numpy_args, python_args):
        np.testing.assert_array_equal(a["x"], b["x"])
    tokens = np.arange(101)
    a = next(ddl.data.lm_batches(tokens, np.int64(2), np.int32(10), start=np.int64(1)))
    b = next(ddl.data.lm_batches(tokens, 2, 10, start=1))
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    train, _ = ddl.data.digits(test_fraction=np.float32(0.25))
    assert len(train["label"]) == len(ddl.data.digits(test_fraction=0.25)[0]["label"])


def stdlib_bytes(files):
    root = sysconfig.get_paths()["stdlib"]
    return b"".join(pathlib.Path(root, name).read_bytes() for name in files)


def test_text_is_the_listed_stdlib_files_split_by_module():
    train, validation = ddl.data.text()
    assert train.dtype == np.uint8 and validation.dtype == np.uint8
    assert train.ndim == validation.ndim == 1
    assert not set(ddl.data.TEXT_TRAIN_FILES) & set(ddl.data.TEXT_VALIDATION_FILES)
    assert bytes(train) == stdlib_bytes(ddl.data.TEXT_TRAIN_FILES)
    assert bytes(validation) == stdlib_bytes(ddl.data.TEXT_VALIDATION_FILES)
    assert 1_400_000 < len(train) < 1_700_000 and 150_000 < len(validation) < 190_000
    # No stretch of validation text appears in the training text.
    for at in range(0, len(validation) - 256, len(validation) // 8):
        assert bytes(validation[at : at + 256]) not in bytes(train)
    again_train, again_validation = ddl.data.text()
    np.testing.assert_array_equal(again_train, train)
    np.testing.assert_array_equal(again_validation, validation)
    again_train[0] = 0  # callers own their arrays
    assert train[0] == ord("#")


def test_text_reads_in_order_and_names_a_missing_file(tmp_path):
    files = ddl.data.TEXT_TRAIN_FILES + ddl.data.TEXT_VALIDATION_FILES
    for i, name in enumerate(files):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(bytes([i]))
    train, validation = ddl.data.text(stdlib=tmp_path)
    n = len(ddl.data.TEXT_TRAIN_FILES)
    assert train.tolist() == list(range(n)) and validation.tolist() == list(range(n, len(files)))
    (tmp_path / "locale.py").unlink()
    version = re.escape(platform.python_version())
    with pytest.raises(FileNotFoundError, match=rf"'locale.py' is missing .*Python {version}"):
        ddl.data.text(stdlib=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ddl.data.text(stdlib=tmp_path / "nowhere")


def test_lm_batches_are_windows_covering_each_epoch_once():
    tokens = np.arange(101, dtype=np.int64)  # 10 windows of context 10 (+1)
    batches = list(ddl.data.lm_batches(tokens, 5, 10, epochs=2))
    assert len(batches) == 4
    for batch in batches:
        window = batch["tokens"]
        assert window.shape == (5, 11) and window.dtype == np.int32
        assert (window[:, 0] % 10 == 0).all()  # starts at multiples of the context
        np.testing.assert_array_equal(window, window[:, :1] + np.arange(11))
    for epoch in (batches[:2], batches[2:]):
        starts = np.concatenate([b["tokens"][:, 0] for b in epoch])
        assert sorted(starts) == list(range(0, 100, 10))
    first, second = (
        np.concatenate([b["tokens"][:, 0] for b in batches[i : i + 2]]) for i in (0, 2)
    )
    assert not np.array_equal(first, second)  # reshuffled
    paired = list(ddl.data.lm_batches(tokens, 5, 10, epochs=2, targets=True))
    for batch, pair in zip(batches, paired, strict=True):
        assert set(pair) == {"inputs", "targets"}
        np.testing.assert_array_equal(pair["inputs"], batch["tokens"][:, :-1])
        np.testing.assert_array_equal(pair["targets"], batch["tokens"][:, 1:])


def test_lm_batches_resume_split_rows_and_follow_the_seed():
    train, _ = ddl.data.text()
    stream = list(itertools.islice(ddl.data.lm_batches(train, 8, 64, seed=3), 6))
    resumed = list(itertools.islice(ddl.data.lm_batches(train, 8, 64, seed=3, start=4), 2))
    for a, b in zip(stream[4:], resumed, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    rows = next(ddl.data.lm_batches(train, 8, 64, seed=3, rows=slice(2, 6)))
    np.testing.assert_array_equal(rows["tokens"], stream[0]["tokens"][2:6])
    other = next(ddl.data.lm_batches(train, 8, 64, seed=4))
    assert not np.array_equal(other["tokens"], stream[0]["tokens"])
    assert stream[0]["tokens"].max() < 256


def test_lm_batches_bad_arguments():
    tokens = np.arange(101)
    with pytest.raises(ValueError, match="tokens must be a 1-D integer array"):
        ddl.data.lm_batches(tokens.reshape(1, -1), 2, 10)
    with pytest.raises(ValueError, match="tokens must be a 1-D integer array"):
        ddl.data.lm_batches(tokens.astype(np.float32), 2, 10)
    with pytest.raises(ValueError, match="context must be an int >= 1"):
        ddl.data.lm_batches(tokens, 2, 0)
    with pytest.raises(ValueError, match="too few for one window"):
        ddl.data.lm_batches(tokens, 1, 101)
    with pytest.raises(
        ValueError, match=r"at most the 10 windows .* must be an int >= 1 and <= 10"
    ):
        ddl.data.lm_batches(tokens, 11, 10)
    with pytest.raises(ValueError, match="lm_batches: start must be an int >= 0"):
        ddl.data.lm_batches(tokens, 2, 10, start=-1)
    with pytest.raises(ValueError, match="lm_batches: rows must be a non-empty slice"):
        ddl.data.lm_batches(tokens, 2, 10, rows=slice(1, 3))
    with pytest.raises(ValueError, match="lm_batches: epochs \\(or None\\) must be an int >= 0"):
        ddl.data.lm_batches(tokens, 2, 10, epochs=-1)
