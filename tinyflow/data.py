"""Small datasets that need no download: digits, Python's own text, synthetic data.

Every example, test and tutorial in TinyFlow trains offline, on data already on the
machine, so a fresh clone works behind a firewall and in CI:

* `load_digits`: the 8x8 handwritten digits (1,797 images, 10 classes) that
  scikit-learn bundles inside its wheel (UCI's "Optical Recognition of Handwritten
  Digits"; Alpaydin & Kaynak 1998). It stands in for MNIST: the original TinyFlow's
  examples train on MNIST, ours train on this in seconds.
* `char_corpus`: English prose shipped with Python itself, the docstrings of the
  standard library's modules, for character-level language models.
* `synthetic_regression`: a linear problem with a known answer, for tests.

Arrays come back as float32 features and int64 labels, in numpy; `minibatches` cuts
them into shuffled batches with a seed of its own, so a run is reproducible.
"""

from __future__ import annotations

import ast
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tinyflow.errors import ArgumentError

__all__ = ["load_digits", "minibatches", "char_corpus", "CharVocab", "synthetic_regression"]


# ----------------------------------------------------------------------------------
# Argument checks: a bad argument is an ArgumentError naming the function and the
# argument (a TypeError and a ValueError both, so older except clauses still catch
# it), never an error from deep inside numpy or a quiet misreading (True as 1).
# ----------------------------------------------------------------------------------

def _whole(function: str, name: str, value: Any, minimum: int) -> int:
    """`value` as an int, refused unless it is a whole number >= `minimum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{function}: {name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ArgumentError(f"{function}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _seed(function: str, value: Any) -> Any:
    """A seed numpy's default_rng takes, as it is: None (fresh entropy), a Generator,
    BitGenerator or SeedSequence, or whole numbers >= 0 (one or a list); anything
    else is an ArgumentError naming the function (numpy's own message, from inside
    its bit generator, named neither)."""
    if value is None or isinstance(value, (np.random.Generator, np.random.BitGenerator,
                                           np.random.SeedSequence)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return _whole(function, "seed", value, 0)
    try:
        if isinstance(value, (bool, np.bool_, float, np.floating, str)):
            raise TypeError("not a whole number")   # (default_rng takes True as 1)
        np.random.default_rng(value)               # a list of ints, say
    except (TypeError, ValueError):
        raise ArgumentError(f"{function}: seed must be a whole number, got {value!r} (or "
                            "anything numpy.random.default_rng takes)") from None
    return value


def _number(function: str, name: str, value: Any) -> float:
    """`value` as a finite float, refused unless it is a real number (not text)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise ArgumentError(f"{function}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ArgumentError(f"{function}: {name} must be a finite number, got {value}")
    return float(value)


# ----------------------------------------------------------------------------------
# Digits
# ----------------------------------------------------------------------------------

def load_digits(test_fraction: float = 0.2, seed: int = 0, layout: str = "flat"
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 8x8 digits, split into train and test sets: (x_train, y_train, x_test, y_test).

    The split is stratified (each class keeps its share in both sets) and depends
    only on `seed`. Pixels (0..16 in the source) are scaled to [0, 1] and then
    standardized with the *training* set's mean and standard deviation, so no test
    information leaks into the inputs. Labels are int64 class indices 0..9.

    layout "flat" gives (N, 64) rows for MLPs; "nchw" gives (N, 1, 8, 8) images for
    convolutions (TinyFlow's conv2d is NCHW, like the original TinyFlow's).
    """
    if layout not in ("flat", "nchw"):
        raise ArgumentError(f"load_digits: layout must be 'flat' or 'nchw', got {layout!r}")
    if not 0.0 < _number("load_digits", "test_fraction", test_fraction) < 1.0:
        raise ArgumentError(f"load_digits: test_fraction must be in (0, 1), got "
                            f"{test_fraction}")
    seed = _seed("load_digits", seed)
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ImportError("tinyflow.data.load_digits reads scikit-learn's bundled copy of "
                          "the digits: pip install 'tinyflow[data]'") from None
    bunch = sklearn_digits()
    images = bunch.data.astype(np.float32) / 16.0
    labels = bunch.target.astype(np.int64)

    # Stratified split: shuffle each class's indices and send the same fraction of
    # every class to the test set.
    rng = np.random.default_rng(seed)
    test_index: list[np.ndarray] = []
    train_index: list[np.ndarray] = []
    for digit in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == digit))
        n_test = int(round(test_fraction * len(members)))
        test_index.append(members[:n_test])
        train_index.append(members[n_test:])
    train = rng.permutation(np.concatenate(train_index))
    test = rng.permutation(np.concatenate(test_index))

    x_train, x_test = images[train], images[test]
    mean, std = x_train.mean(), x_train.std()
    x_train = ((x_train - mean) / std).astype(np.float32)
    x_test = ((x_test - mean) / std).astype(np.float32)
    if layout == "nchw":
        x_train = x_train.reshape(-1, 1, 8, 8)
        x_test = x_test.reshape(-1, 1, 8, 8)
    return x_train, labels[train], x_test, labels[test]


def minibatches(x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool = True,
                seed: int = 0, drop_last: bool = False
                ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (x_batch, y_batch) pairs covering the data once (one epoch).

    With `shuffle`, the order is a permutation drawn from `seed` (pass the epoch
    number mixed into the seed to get a new order each epoch). The last batch is
    smaller when the sizes don't divide, unless `drop_last`; note that a new batch
    size makes `Session.run` compile (and cache) a second program.

    The arguments are checked when it is called, not at the first batch (a generator
    function would run no line of its body before the loop asks for a batch).
    """
    batch_size = _whole("minibatches", "batch_size", batch_size, 1)
    seed = _seed("minibatches", seed)
    x, y = np.asarray(x), np.asarray(y)  # lists too: they are indexed by arrays below
    if x.ndim == 0 or y.ndim == 0:
        raise ArgumentError(f"minibatches: x and y must be arrays of examples, got shapes "
                            f"{x.shape} and {y.shape}")
    if len(x) != len(y):
        raise ArgumentError(f"minibatches: x and y differ in length: {len(x)} vs {len(y)}")
    order = np.random.default_rng(seed).permutation(len(x)) if shuffle else np.arange(len(x))
    stop = len(x) - len(x) % batch_size if drop_last else len(x)
    return _batches(x, y, order, batch_size, stop)


def _batches(x: np.ndarray, y: np.ndarray, order: np.ndarray, batch_size: int, stop: int
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The batches of `minibatches`: rows order[start:start + batch_size] of x and y."""
    for start in range(0, stop, batch_size):
        index = order[start:start + batch_size]
        yield x[index], y[index]


# ----------------------------------------------------------------------------------
# Text: the standard library's docstrings
# ----------------------------------------------------------------------------------

def _stdlib_modules() -> list[Path]:
    """The standard library's top-level modules, in a fixed (sorted) order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))


def _docstrings(source: str) -> list[str]:
    """The docstrings of a module, then of its classes and functions (breadth first)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:  # skip one-word stubs ("Return x.")
                found.append(doc)
    return found


def char_corpus(max_chars: int = 300_000) -> str:
    """English text that ships with Python: docstrings of standard-library modules.

    Modules are read in sorted order and their docstrings joined (blank line
    between) until `max_chars`, so the corpus is the same on every run of the same
    Python version. Characters outside printable ASCII (and newline) become "?",
    which keeps the vocabulary small (about 95 symbols).
    """
    max_chars = _whole("char_corpus", "max_chars", max_chars, 1)
    pieces: list[str] = []
    total = 0
    for path in _stdlib_modules():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for doc in _docstrings(source):
            pieces.append(doc)
            total += len(doc) + 2
            if total >= max_chars:
                break
        if total >= max_chars:
            break
    text = "\n\n".join(pieces)[:max_chars]
    if not text:
        raise RuntimeError(f"no docstrings found under {sysconfig.get_paths()['stdlib']}")
    return "".join(ch if ch == "\n" or " " <= ch <= "~" else "?" for ch in text)


class CharVocab:
    """A character vocabulary: `encode` text to int64 ids, `decode` ids back.

    Ids are assigned in sorted character order, so the same text gives the same
    vocabulary. Characters unseen when the vocabulary was built are refused.
    """

    def __init__(self, text: str) -> None:
        self.chars: list[str] = sorted(set(text))
        self.index: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.fromiter((self.index[ch] for ch in text), dtype=np.int64,
                               count=len(text))
        except KeyError as err:
            raise ArgumentError(f"CharVocab.encode: character {err.args[0]!r} is not in "
                                "the vocabulary") from None

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


# ----------------------------------------------------------------------------------
# Synthetic
# ----------------------------------------------------------------------------------

def synthetic_regression(n: int = 256, in_dim: int = 8, out_dim: int = 1,
                         noise: float = 0.01, seed: int = 0, return_weights: bool = False):
    """A linear regression problem with a known answer: y = x @ w + b + noise.

    Returns (x, y) float32 arrays of shapes (n, in_dim) and (n, out_dim); with
    `return_weights`, (x, y, w, b) so a test can compare what it learned.
    """
    name = "synthetic_regression"
    n, in_dim, out_dim = (_whole(name, arg, value, 1) for arg, value in
                          (("n", n), ("in_dim", in_dim), ("out_dim", out_dim)))
    if _number(name, "noise", noise) < 0:
        raise ArgumentError(f"{name}: noise must be >= 0, got {noise}")
    rng = np.random.default_rng(_seed(name, seed))
    x = rng.standard_normal((n, in_dim)).astype(np.float32)
    w = rng.standard_normal((in_dim, out_dim)).astype(np.float32)
    b = rng.standard_normal(out_dim).astype(np.float32)
    y = (x @ w + b + noise * rng.standard_normal((n, out_dim))).astype(np.float32)
    return (x, y, w, b) if return_weights else (x, y)
