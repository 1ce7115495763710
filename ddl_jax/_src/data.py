"""Bundled real data and global-batch iterators."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Dataset = dict[str, np.ndarray]


def digits(
    *, test_fraction: float = 0.2, seed: int = 0, flatten: bool = True
) -> tuple[Dataset, Dataset]:
    """The 1,797 8x8 handwritten digits that ship inside scikit-learn, split train/test.

    Pixels are scaled from 0..16 to [0, 1]; the split is stratified by label.

    Args:
      test_fraction: share of the examples held out for testing, in (0, 1).
      seed: seed of the shuffled split.
      flatten: images as ``float32[n, 64]`` if true, else ``float32[n, 8, 8, 1]``.

    Returns:
      ``(train, test)``, each ``{"image": float32[n, ...], "label": int32[n]}``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction must be in (0, 1), got {test_fraction!r}.")
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    if not flatten:
        x = x.reshape(-1, 8, 8, 1)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return {"image": x_tr, "label": y_tr}, {"image": x_te, "label": y_te}


def batches(
    data: Dataset,
    batch_size: int,
    *,
    seed: int = 0,
    epochs: int | None = None,
    start: int = 0,
    rows: slice | None = None,
) -> Iterator[Dataset]:
    """Yields shuffled global batches of ``batch_size`` examples, reshuffled every epoch.

    The last partial batch of an epoch is dropped, so every batch has the same shape and
    a jitted step compiles once. Batch ``s`` depends only on ``seed`` and ``s``: the
    stream started at ``start=s`` is the tail of the stream started at 0 (a resumed run
    sees exactly the batches an uninterrupted run would), and ``rows`` cuts the same
    batches for one process (see ``ddl.launch.process_rows``).

    Args:
      data: dict of arrays sharing a leading example axis.
      batch_size: examples per global batch; at most the number of examples.
      seed: seed of the shuffling.
      epochs: passes over the data; ``None`` repeats forever.
      start: index of the first batch to yield, >= 0.
      rows: only these rows of each global batch (a slice of ``range(batch_size)``);
        ``None`` yields whole batches.
    """
    if not isinstance(data, dict) or not data:
        raise ValueError(
            "batches: data must be a non-empty dict of arrays, like ddl.data.digits()."
        )
    sizes = {k: len(v) for k, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batches: data arrays disagree on the number of examples: {sizes}.")
    n = next(iter(sizes.values()))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ValueError(f"batches: batch_size must be an int in [1, {n}], got {batch_size!r}.")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"batches: start must be an int >= 0, got {start!r}.")
    if rows is None:
        rows = slice(0, batch_size)
    if (
        not isinstance(rows, slice)
        or rows.step not in (None, 1)
        or not (
            0 <= (rows.start or 0) < (batch_size if rows.stop is None else rows.stop) <= batch_size
        )
    ):
        raise ValueError(
            f"batches: rows must be a non-empty slice of range({batch_size}) with step 1, "
            f"got {rows!r}."
        )
    return _shuffled_batches(data, n, batch_size, seed, epochs, start, rows)


def _shuffled_batches(data, n, batch_size, seed, epochs, start, rows) -> Iterator[Dataset]:
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    epoch, first = divmod(start, per_epoch)
    for _ in range(epoch):  # one permutation per epoch: skipping replays only the draws
        rng.permutation(n)
    while epochs is None or epoch < epochs:
        order = rng.permutation(n)
        for b in range(first, per_epoch):
            idx = order[b * batch_size : (b + 1) * batch_size][rows]
            yield {k: v[idx] for k, v in data.items()}
        epoch, first = epoch + 1, 0
