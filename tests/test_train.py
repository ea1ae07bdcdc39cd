"""The datasets (tinyflow/data.py) and the training scripts (tutorials/train_*.py).

Each script runs once, at its --quick size, in a fresh process (as a user runs it),
and its parseable `key=value` lines are checked: accuracy, falling loss, a checkpoint
that restores to the same score, and (for the MLP, run through `tinyflow train`) a
DebugRecord from --trace.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyflow import cli, trace
from tinyflow.data import CharVocab, char_corpus, load_digits, minibatches, synthetic_regression

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def _run(command: list[str], tmp_path: Path) -> dict[str, str]:
    """Run a training command in tmp_path; return its key=value lines (and the sample)."""
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    values: dict[str, str] = {}
    lines = result.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("--- sample"):
            values["sample"] = "\n".join(lines[i + 1:])
            break
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return values


# ----------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------

def test_load_digits_split_is_stratified_deterministic_and_normalized():
    x_train, y_train, x_test, y_test = load_digits(test_fraction=0.2, seed=3)
    assert x_train.shape == (len(y_train), 64) and x_test.shape == (len(y_test), 64)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert len(y_train) + len(y_test) == 1797
    assert abs(len(y_test) - 0.2 * 1797) <= 10
    # every class has its share of the test set
    assert np.all(np.abs(np.bincount(y_test, minlength=10) - 0.2 * np.bincount(
        np.concatenate([y_train, y_test]), minlength=10)) <= 1)
    # standardized with training statistics
    assert abs(float(x_train.mean())) < 1e-4 and abs(float(x_train.std()) - 1) < 1e-3
    again = load_digits(test_fraction=0.2, seed=3)
    np.testing.assert_array_equal(again[0], x_train)
    other = load_digits(test_fraction=0.2, seed=4)
    assert not np.array_equal(other[1], y_train)
    # no image is in both sets (the 1,797 images are all distinct)
    train_rows = {row.tobytes() for row in x_train}
    assert len(train_rows) == len(x_train)
    assert not any(row.tobytes() in train_rows for row in x_test)


def test_load_digits_nchw_and_bad_arguments():
    x_train, _, x_test, _ = load_digits(layout="nchw")
    assert x_train.shape[1:] == (1, 8, 8) and x_test.shape[1:] == (1, 8, 8)
    with pytest.raises(ValueError, match="layout"):
        load_digits(layout="nhwc")
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.5)


def test_minibatches_cover_each_example_once():
    x = np.arange(10, dtype=np.float32)[:, None]
    y = np.arange(10)
    batches = list(minibatches(x, y, 4, shuffle=True, seed=1))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    seen = np.concatenate([b[1] for b in batches])
    assert sorted(seen) == list(range(10)) and list(seen) != list(range(10))
    for xb, yb in batches:
        np.testing.assert_array_equal(xb[:, 0], yb)  # rows stay paired
    assert [len(b[1]) for b in minibatches(x, y, 4, drop_last=True)] == [4, 4]
    assert [list(b[1]) for b in minibatches(x, y, 5, shuffle=False)] == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="differ in length"):
        next(minibatches(x, y[:3], 2))


def test_char_corpus_is_deterministic_capped_and_encodable():
    text = char_corpus(20_000)
    assert len(text) == 20_000 and text == char_corpus(20_000)
    assert all(ch == "\n" or " " <= ch <= "~" for ch in text)
    assert "the" in text  # English prose, not code
    vocab = CharVocab(text)
    ids = vocab.encode(text[:500])
    assert ids.dtype == np.int64 and ids.max() < len(vocab)
    assert vocab.decode(ids) == text[:500]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        CharVocab("abc").encode("abd")


def test_synthetic_regression_has_the_stated_answer():
    x, y, w, b = synthetic_regression(n=64, in_dim=3, out_dim=2, noise=0.0, seed=1,
                                      return_weights=True)
    assert x.shape == (64, 3) and y.shape == (64, 2) and x.dtype == np.float32
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,message", [
    (lambda: load_digits(seed=-1), "load_digits: seed must be >= 0, got -1"),
    (lambda: load_digits(seed=1.5), "load_digits: seed must be a whole number, got 1.5"),
    (lambda: load_digits(test_fraction="0.2"), "test_fraction must be a number, got '0.2'"),
    (lambda: load_digits(test_fraction=float("nan")), "test_fraction must be a finite"),
    (lambda: load_digits(layout="nhwc"), "layout must be 'flat' or 'nchw'"),
    (lambda: minibatches(np.ones((10, 3)), np.arange(10), 2.5), "batch_size must be a whole"),
    (lambda: minibatches(np.ones((10, 3)), np.arange(10), "4"), "batch_size must be a whole"),
    (lambda: minibatches(np.ones((10, 3)), np.arange(10), True), "batch_size must be a whole"),
    (lambda: minibatches(np.ones((10, 3)), np.arange(10), 0), "batch_size must be >= 1"),
    (lambda: minibatches(np.ones((10, 3)), np.arange(3), 2), "differ in length"),
    (lambda: char_corpus(2.5), "char_corpus: max_chars must be a whole number, got 2.5"),
    (lambda: synthetic_regression(n=-1), "synthetic_regression: n must be >= 1, got -1"),
    (lambda: synthetic_regression(n=2.5), "n must be a whole number"),
    (lambda: synthetic_regression(in_dim=0), "in_dim must be >= 1"),
    (lambda: synthetic_regression(noise=-1.0), "noise must be >= 0"),
    (lambda: CharVocab("abc").encode("abz"), "'z' is not in the vocabulary"),
])
def test_data_arguments_are_argument_errors(call, message):
    # They were errors from inside numpy (seed=-1, n=-1), bare TypeErrors ("0.2", 2.5),
    # or quietly taken (minibatches(..., True) gave batches of one).
    import tinyflow as tf
    with pytest.raises(tf.ArgumentError, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def test_minibatches_takes_lists_and_numpy_integers():
    batches = list(minibatches([[1]] * 10, list(range(10)), np.int64(4), seed=np.int64(2)))
    assert [len(b[1]) for b in batches] == [4, 4, 2]


# ----------------------------------------------------------------------------------
# Training scripts
# ----------------------------------------------------------------------------------

def test_mlp_quick_through_the_cli_with_trace_and_checkpoint(tmp_path):
    record_path = tmp_path / "mlp.tfdbg.json"
    command = [sys.executable, "-c", "import sys; from tinyflow.cli import main; "
               "sys.exit(main())", "train", "mlp", "--quick", "--trace", str(record_path),
               "--checkpoint", str(tmp_path / "mlp.npz")]
    out = _run(command, tmp_path)
    accuracy = float(out["test_accuracy"])
    assert accuracy >= 0.90
    assert float(out["restored_test_accuracy"]) == accuracy
    assert float(out["final_loss"]) < float(out["first_loss"])
    assert (tmp_path / "mlp.npz").is_file()

    record = trace.load(record_path)   # validates the DebugRecord schema
    losses = record["scalars"]["loss"]
    steps_per_epoch = -(-1438 // 32)
    assert [step for step, _ in losses] == list(range(5 * steps_per_epoch))
    assert len(record["scalars"]["test_accuracy"]) == 5
    assert record["timelines"] and record["graphs"]
    ops = {node["op"] for node in record["graphs"][0]["nodes"]}
    assert {"matmul", "softmax_cross_entropy", "assign"} <= ops  # the training step


def test_cnn_quick(tmp_path):
    out = _run([sys.executable, str(TUTORIALS / "train_cnn.py"), "--quick",
                "--checkpoint", str(tmp_path / "cnn.npz")], tmp_path)
    assert float(out["test_accuracy"]) >= 0.80
    assert float(out["restored_test_accuracy"]) == float(out["test_accuracy"])
    assert float(out["final_loss"]) < float(out["first_loss"])


def test_charlm_quick_loss_falls_and_it_samples(tmp_path):
    out = _run([sys.executable, str(TUTORIALS / "train_charlm.py"), "--quick",
                "--checkpoint", str(tmp_path / "lm.npz")], tmp_path)
    start, end = float(out["loss_start"]), float(out["loss_end"])
    vocab = int(out["vocab_size"])
    assert abs(start - np.log(vocab)) < 0.3  # an untrained model guesses uniformly
    assert end < start - 0.8
    assert float(out["restored_loss"]) == pytest.approx(end, rel=1e-6)
    prompt, continuation = out["sample"].split("|", 1)
    assert len(continuation) == 80


def test_every_script_has_help():
    for name, path in cli.training_scripts().items():
        if name not in ("mlp", "cnn", "charlm"):
            continue  # other scripts have their owners' tests
        result = subprocess.run([sys.executable, str(path), "--help"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and "--quick" in result.stdout, name


def test_data_seeds_take_what_numpy_default_rng_takes():
    # Review: the seed check (this round) refused a Generator, a SeedSequence and a
    # list of ints, which numpy's default_rng takes and which worked before.
    x, y = np.arange(10.0)[:, None], np.arange(10)
    orders = [[b[1].tolist() for b in minibatches(x, y, 5, seed=seed)]
              for seed in (np.random.default_rng(3), np.random.SeedSequence(3), [3, 4], 3)]
    assert all(sorted(sum(o, [])) == list(range(10)) for o in orders)
    assert orders[1] == [[b[1].tolist() for b in minibatches(x, y, 5, seed=3)]][0]
