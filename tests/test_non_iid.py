"""Label-skewed shares (Dirichlet alpha) and the global batches built from them."""

import numpy as np
import pytest

import ddl_jax as ddl


def label_mix(labels, classes=10):
    return np.bincount(labels, minlength=classes) / len(labels)


@pytest.fixture(scope="module")
def train():
    return ddl.data.digits()[0]


def test_shares_partition_the_examples_and_skew_with_small_alpha(train):
    labels = train["label"]
    mixes = {}
    for alpha in (0.1, 100.0):
        shares = ddl.data.dirichlet_shares(labels, 8, alpha, seed=3)
        joined = np.concatenate(shares)
        assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
        mixes[alpha] = [label_mix(labels[s]) for s in shares]
    overall = label_mix(labels)
    gap = {a: np.mean([np.abs(m - overall).sum() / 2 for m in ms]) for a, ms in mixes.items()}
    # total variation from the global label mix: about 0 when i.i.d., large when skewed
    assert gap[100.0] < 0.1 < 0.5 < gap[0.1]


def test_more_workers_than_a_class_has_examples_is_refused_with_the_reason():
    """Each class is split on its own: 100 examples a class reach at most 100 of 500
    workers, so at any alpha some may get none; the error says why, not only "larger"."""
    labels = np.repeat(np.arange(10), 100)
    with pytest.raises(ValueError, match=r"a class of 100 examples reaches at most 100 of them"):
        ddl.data.dirichlet_shares(labels, 500, 1e6, seed=0)


def test_each_workers_rows_come_from_its_share_and_resume(train):
    shares = ddl.data.dirichlet_shares(train["label"], 4, 0.3, seed=0)
    stream = ddl.data.non_iid_batches(train, 32, workers=4, alpha=0.3, seed=0)
    first = [next(stream) for _ in range(60)]  # more than a pass over the smallest share
    by_image = {row.tobytes(): i for i, row in enumerate(train["image"])}
    for batch in first:
        for w in range(4):
            rows = [by_image[x.tobytes()] for x in batch["image"][8 * w : 8 * (w + 1)]]
            assert set(rows) <= set(shares[w])
            np.testing.assert_array_equal(batch["label"][8 * w : 8 * (w + 1)], train["label"][rows])
    resumed = ddl.data.non_iid_batches(train, 32, workers=4, alpha=0.3, seed=0, start=40)
    for expected in first[40:45]:
        np.testing.assert_array_equal(next(resumed)["image"], expected["image"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 30, "workers": 4, "alpha": 0.5}, "multiple of workers 4"),
        ({"batch_size": 32, "workers": 4, "alpha": 0.0}, "alpha must be"),
        ({"batch_size": 32, "workers": 4, "alpha": 0.5, "label": "y"}, "labels at 'y'"),
    ],
)
def test_bad_arguments(train, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ddl.data.non_iid_batches(train, **kwargs)


def test_a_small_class_does_not_rule_out_every_alpha():
    labels = np.array([0, 0] + [1] * 1000)
    with pytest.raises(ValueError, match="a class of 2 examples reaches at most 2 of them: "
                       "use fewer workers, or another alpha") as e:  # fmt: skip
        ddl.data.dirichlet_shares(labels, 5, 0.01, seed=0)
    assert "whatever" not in str(e.value)
    assert all(len(s) for s in ddl.data.dirichlet_shares(labels, 5, 1.0, seed=0))


def test_arrays_of_different_lengths_are_refused(train):
    data = {**train, "image": train["image"][:10]}
    with pytest.raises(ValueError, match="non_iid_batches: data arrays disagree on the number"):
        ddl.data.non_iid_batches(data, 32, workers=4, alpha=0.5)


def test_too_skewed_for_every_worker_says_so():
    with pytest.raises(ValueError, match="larger alpha or fewer workers"):
        ddl.data.dirichlet_shares(np.zeros(3, np.int32), 3, 1e-3)
