"""Bundled real data and global-batch iterators."""

from __future__ import annotations

import os
import platform
import sysconfig
from collections.abc import Iterator

import numpy as np

from ddl_jax._src.core.strategy import check_bool, check_int, check_real

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

    test_fraction = check_real(
        "digits: test_fraction", test_fraction, minimum=0, maximum=1, exclusive=True
    )
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
    replace: bool = False,
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
      replace: draw each batch's examples with replacement instead, batch ``s`` from
        ``(seed, s)`` alone, endlessly (``epochs`` must be ``None``): for a batch larger
        than the data (many workers, each with its rows).
    """
    if not isinstance(data, dict) or not data:
        raise ValueError(
            "batches: data must be a non-empty dict of arrays, like ddl.data.digits()."
        )
    n = count_examples("batches", data)
    check_bool("batches: replace", replace)
    batch_size = check_int("batches: batch_size", batch_size, minimum=1)
    if replace and epochs is not None:
        raise ValueError(
            f"batches: epochs={epochs!r} counts passes without replacement; with "
            "replace=True the stream is endless: drop epochs."
        )
    if not replace and batch_size > n:
        raise ValueError(
            f"batches: batch_size={batch_size} is more than the {n} examples; draw with "
            "replacement (replace=True) or give a smaller batch."
        )
    epochs, start, rows = _check_stream("batches", batch_size, epochs, start, rows)
    if replace:
        return _sampled_batches(data, n, batch_size, seed, start, rows)
    return _shuffled_batches(data, n, batch_size, seed, epochs, start, rows)


def count_examples(fn: str, data: Dataset) -> int:
    """The number of examples of ``data``, whose arrays must agree on it."""
    sizes = {k: len(v) for k, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{fn}: data arrays disagree on the number of examples: {sizes}.")
    return next(iter(sizes.values()))


def _sampled_batches(data, n, batch_size, seed, start, rows) -> Iterator[Dataset]:
    step = start
    while True:
        idx = np.random.default_rng((seed, step)).integers(0, n, batch_size)[rows]
        yield {k: v[idx] for k, v in data.items()}
        step += 1


def _check_stream(
    fn: str, batch_size: int, epochs: int | None, start: int, rows: slice | None
) -> tuple[int | None, int, slice]:
    """Checks ``epochs``, ``start`` and ``rows`` of a batch stream; returns them as Python
    ints, ``rows`` made explicit."""
    if epochs is not None:
        epochs = check_int(f"{fn}: epochs (or None)", epochs, minimum=0)
    start = check_int(f"{fn}: start", start, minimum=0)
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
            f"{fn}: rows must be a non-empty slice of range({batch_size}) with step 1, "
            f"got {rows!r}."
        )
    return epochs, start, rows


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


# Modules of the standard library present in CPython 3.11, 3.12 and 3.13 whose size moves
# by under 3% between those releases; read as bytes in this order.
TEXT_TRAIN_FILES: tuple[str, ...] = (
    "argparse.py",
    "collections/__init__.py",
    "textwrap.py",
    "functools.py",
    "difflib.py",
    "pydoc.py",
    "_pydecimal.py",
    "pprint.py",
    "subprocess.py",
    "json/decoder.py",
    "json/encoder.py",
    "http/client.py",
    "http/server.py",
    "unittest/case.py",
    "doctest.py",
    "string.py",
    "heapq.py",
    "optparse.py",
    "trace.py",
    "cmd.py",
    "sched.py",
    "socket.py",
    "selectors.py",
    "pickletools.py",
    "weakref.py",
    "abc.py",
    "contextlib.py",
    "codecs.py",
    "email/message.py",
    "urllib/parse.py",
    "shlex.py",
    "operator.py",
    "hmac.py",
)
TEXT_VALIDATION_FILES: tuple[str, ...] = (
    "gettext.py",
    "locale.py",
    "xml/dom/minidom.py",
)


def text(*, stdlib: str | os.PathLike[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A byte-level language-modelling corpus: Python's own standard-library sources.

    Needs no download: the text is the ``.py`` files that ship with every CPython, found
    with ``sysconfig.get_paths()["stdlib"]``. The files are a fixed list present in CPython
    3.11, 3.12 and 3.13, read as bytes in order and concatenated: the 33 modules of
    ``TEXT_TRAIN_FILES`` (``argparse.py`` ... ``hmac.py``) are the training split and the
    3 whole modules of ``TEXT_VALIDATION_FILES`` (``gettext.py``, ``locale.py``,
    ``xml/dom/minidom.py``) the validation split, so no module is in both. Each token is
    one byte (vocabulary 256). The content is the running Python's sources, so it is
    identical on every call but differs slightly between Python releases and builds:
    1,556,327 training and 168,555 validation bytes on CPython 3.11.7, within 1% of that
    on 3.12 and 3.13.

    Args:
      stdlib: directory of the standard library to read; ``None`` is the running Python's.

    Returns:
      ``(train, validation)``, each ``uint8[n]``; batch them with
      :func:`lm_batches`.

    Raises:
      FileNotFoundError: a file of the list is missing (a Python installed without its
        ``.py`` sources); the message names the file and the Python version.

    Example:
      >>> import ddl_jax as ddl
      >>> train, validation = ddl.data.text()
      >>> train.dtype, train.ndim, len(train) > 1_500_000, len(validation) > 150_000
      (dtype('uint8'), 1, True, True)
      >>> bytes(train[:16])  # argparse.py comes first
      b'# Author: Steven'
    """
    root = sysconfig.get_paths()["stdlib"] if stdlib is None else os.fspath(stdlib)
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"text: stdlib directory {root!r} does not exist (Python {platform.python_version()})."
        )

    def read(files: tuple[str, ...]) -> np.ndarray:
        chunks = []
        for name in files:
            path = os.path.join(root, *name.split("/"))
            try:
                with open(path, "rb") as f:
                    chunks.append(f.read())
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"text: corpus file {name!r} is missing from the standard library at "
                    f"{root!r} (Python {platform.python_version()}); ddl.data.text reads "
                    "the .py sources that CPython 3.11-3.13 install, which an installation "
                    "without its .py files (only .pyc or a zip) lacks."
                ) from None
        return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()

    return read(TEXT_TRAIN_FILES), read(TEXT_VALIDATION_FILES)


def lm_batches(
    tokens: np.ndarray,
    batch_size: int,
    context: int,
    *,
    seed: int = 0,
    epochs: int | None = None,
    start: int = 0,
    rows: slice | None = None,
    targets: bool = False,
) -> Iterator[Dataset]:
    """Yields global batches of token windows for next-token prediction.

    The sequence is cut into the ``(len(tokens) - 1) // context`` windows of
    ``context + 1`` tokens that start at multiples of ``context`` (neighbours share one
    token, so every token after the first is predicted exactly once per epoch); the
    windows are then shuffled and batched exactly as :func:`batches` does, so batch ``s``
    depends only on ``seed`` and ``s``, ``start`` resumes a stream, ``rows`` cuts one
    process's rows, and the last partial batch of an epoch is dropped.

    Args:
      tokens: 1-D integer array, such as a split of :func:`text`.
      batch_size: windows per global batch; at most the number of windows.
      context: tokens the model sees per window, >= 1.
      seed: seed of the shuffling.
      epochs: passes over the windows; ``None`` repeats forever.
      start: index of the first batch to yield, >= 0.
      rows: only these rows of each global batch (a slice of ``range(batch_size)``);
        ``None`` yields whole batches.
      targets: yield ``{"inputs", "targets"}`` instead of ``{"tokens"}``.

    Yields:
      ``{"tokens": int32[b, context + 1]}``, or with ``targets=True``
      ``{"inputs": int32[b, context], "targets": int32[b, context]}`` where
      ``targets[:, t] == inputs[:, t + 1]`` for ``t < context - 1``; ``b`` is
      ``batch_size`` or the length of ``rows``.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            "lm_batches: tokens must be a 1-D integer array, like a split of "
            f"ddl.data.text(); got {tokens.dtype}{list(tokens.shape)}."
        )
    context = check_int("lm_batches: context", context, minimum=1)
    if len(tokens) < context + 1:
        raise ValueError(
            f"lm_batches: tokens has {len(tokens)} tokens, too few for one window of "
            f"context + 1 = {context + 1}."
        )
    n = (len(tokens) - 1) // context
    name = f"lm_batches: batch_size (at most the {n} windows of {context + 1} tokens)"
    batch_size = check_int(name, batch_size, minimum=1, maximum=n)
    epochs, start, rows = _check_stream("lm_batches", batch_size, epochs, start, rows)
    starts = {"start": np.arange(n) * context}
    offsets = np.arange(context + 1)
    return _windows(tokens, starts, n, batch_size, seed, epochs, start, rows, offsets, targets)


def _windows(tokens, starts, n, batch_size, seed, epochs, start, rows, offsets, targets):
    for batch in _shuffled_batches(starts, n, batch_size, seed, epochs, start, rows):
        window = tokens[batch["start"][:, None] + offsets].astype(np.int32)
        if targets:
            yield {"inputs": window[:, :-1], "targets": window[:, 1:]}
        else:
            yield {"tokens": window}
