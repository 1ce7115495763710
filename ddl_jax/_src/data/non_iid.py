"""Non-i.i.d. data: each worker a label-skewed share of the examples (Dirichlet alpha)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ddl_jax._src.core.strategy import check_int, check_real
from ddl_jax._src.data.datasets import Dataset, count_examples

#: Draws of the class proportions before giving up on every worker getting an example.
_TRIES = 100


def dirichlet_shares(
    labels: np.ndarray, workers: int, alpha: float, *, seed: int = 0
) -> list[np.ndarray]:
    """Splits the examples among ``workers`` with label skew, class by class.

    For each class, the proportions of its examples going to each worker are drawn from a
    symmetric Dirichlet(``alpha``) over the workers, and its examples cut at the rounded
    cumulative proportions: large alpha gives every worker about the global label mix
    (i.i.d. as alpha -> infinity, while every class has many more examples than there are
    workers), small alpha gives each worker a few classes, and the shares' sizes vary.
    Each class is split on its own, so with more workers than a class has examples a
    share holds a few classes whatever alpha, and some workers may get none. The shares
    partition the examples; proportions are redrawn (seeded) until every worker has at
    least one example.

    This is the per-class split of Yurochkin et al. 2019 as NIID-Bench runs it
    (Xtra-Computing/NIID-Bench ``utils.py``, ``partition_data``, ``"noniid-labeldir"``),
    without NIID-Bench's cap on a worker's share (a worker past the mean size gets no more
    of the later classes) and with at least one example a worker where it asks for 10.
    It is not Hsu et al.'s scheme (arXiv:1909.06335), where each worker's label mix is
    drawn, ``q ~ Dir(alpha p)``, and the workers' shares are equal: at the same alpha
    the two skew differently.

    References:
      Yurochkin et al., "Bayesian nonparametric federated learning of neural networks",
      ICML 2019. Li, Diao, Chen, He, "Federated learning on non-IID data silos: an
      experimental study", ICDE 2022 (NIID-Bench).

    Args:
      labels: 1-D integer class labels, one per example.
      workers: the number of shares, >= 1.
      alpha: the Dirichlet concentration, > 0.
      seed: seed of the draws.

    Returns:
      ``workers`` sorted index arrays into ``labels``, disjoint, covering every example.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or not len(labels):
        raise ValueError(
            f"dirichlet_shares: labels must be a non-empty 1-D integer array, got "
            f"{labels.dtype}{list(labels.shape)}."
        )
    workers = check_int("dirichlet_shares: workers", workers, minimum=1, maximum=len(labels))
    alpha = check_real("dirichlet_shares: alpha", alpha, minimum=0, exclusive=True)
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    for _ in range(_TRIES):
        shares: list[list[np.ndarray]] = [[] for _ in range(workers)]
        for idx in by_class:
            cuts = np.cumsum(rng.dirichlet(np.full(workers, alpha)))[:-1] * len(idx)
            for w, part in enumerate(np.split(idx, np.round(cuts).astype(int))):
                shares[w].append(part)
        out = [np.sort(np.concatenate(parts)) for parts in shares]
        if all(len(s) for s in out):
            return out
    smallest = min(len(idx) for idx in by_class)
    why = "; use a larger alpha or fewer workers."
    if smallest < workers:
        why = (
            f"; each class is split on its own, and a class of {smallest} examples reaches "
            f"at most {smallest} of them: use fewer workers, or another alpha."
        )
    raise ValueError(
        f"dirichlet_shares: in {_TRIES} draws at alpha={alpha:g} some of the {workers} "
        f"workers got no example{why}"
    )


def non_iid_batches(
    data: Dataset,
    batch_size: int,
    *,
    workers: int,
    alpha: float,
    seed: int = 0,
    start: int = 0,
    label: str = "label",
) -> Iterator[Dataset]:
    """Yields global batches whose worker slices come from label-skewed shares.

    The examples are split by :func:`dirichlet_shares`; rows ``[i b/N, (i+1) b/N)`` of every
    global batch (worker i's shard under every strategy here) are the next ``b/N`` examples
    of worker i's share, read in a fresh seeded shuffle per pass over it (a share smaller
    than ``b/N`` repeats examples within a batch). The stream is infinite, and batch ``s``
    depends only on ``seed`` and ``s``: ``start`` resumes it.

    Args:
      data: dict of arrays sharing a leading example axis, with integer labels at ``label``.
      batch_size: examples per global batch, a multiple of ``workers``.
      workers: N, the workers the batch is sharded over (the mesh's ``data`` axis).
      alpha: the Dirichlet concentration, > 0 (smaller is more skewed).
      seed: seed of the split and of the shuffles.
      start: index of the first batch to yield, >= 0.
      label: the key of the labels in ``data``.
    """
    if not isinstance(data, dict) or label not in data:
        raise ValueError(
            f"non_iid_batches: data must be a dict of arrays with labels at {label!r}, "
            "like ddl.data.digits()[0]."
        )
    count_examples("non_iid_batches", data)
    workers = check_int("non_iid_batches: workers", workers, minimum=1)
    batch_size = check_int("non_iid_batches: batch_size", batch_size, minimum=workers)
    if batch_size % workers:
        raise ValueError(
            f"non_iid_batches: batch_size {batch_size} must be a multiple of workers {workers}."
        )
    start = check_int("non_iid_batches: start", start, minimum=0)
    shares = dirichlet_shares(data[label], workers, alpha, seed=seed)
    return _skewed_stream(data, shares, batch_size // workers, seed, start)


def _skewed_stream(data, shares, per_worker, seed, start) -> Iterator[Dataset]:
    step = start
    while True:
        rows = np.concatenate(
            [_positions(s, w, step, per_worker, seed) for w, s in enumerate(shares)]
        )
        yield {k: v[rows] for k, v in data.items()}
        step += 1


def _positions(share: np.ndarray, worker: int, step: int, per_worker: int, seed: int):
    """Worker ``worker``'s examples of batch ``step``: positions ``step * per_worker`` onward
    of its stream, the concatenation of seeded permutations of its share (one per pass)."""
    positions = np.arange(step * per_worker, (step + 1) * per_worker)
    passes, offsets = np.divmod(positions, len(share))
    out = np.empty(per_worker, share.dtype)
    for p in np.unique(passes):  # one permutation per pass the batch touches
        order = np.random.default_rng([seed, worker, int(p)]).permutation(len(share))
        out[passes == p] = share[order[offsets[passes == p]]]
    return out
