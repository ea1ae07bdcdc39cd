"""Checkpoints (tinyflow/saver.py): round trips, refusals, no pickle, atomic writes."""

import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.saver import CheckpointError, Saver, read_checkpoint


def _model():
    """Three Variables of different shapes and dtypes, initialized in a Session."""
    w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="ck_w")
    b = tf.Variable(np.array([0.5, -1.5]), name="ck_b", dtype=np.float64)
    step = tf.Variable(np.zeros((), np.float32), name="ck_step", trainable=False)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    return sess, [w, b, step]


def test_round_trip_restores_values_shapes_and_dtypes(tmp_path):
    sess, variables = _model()
    w, b, step = variables
    sess.run(tf.assign(step, step + 3.0))
    saver = Saver(variables)
    path = saver.save(sess, tmp_path / "model.npz")
    assert Path(path) == tmp_path / "model.npz"

    fresh = tf.Session()
    saver.restore(fresh, path)
    for var in variables:
        saved, restored = sess.variables[var], fresh.variables[var]
        assert restored.shape == saved.shape and restored.dtype == saved.dtype
        np.testing.assert_array_equal(restored, saved)
    assert fresh.variables[step].shape == ()  # a scalar stays a scalar
    # The restored Session computes with the restored values.
    np.testing.assert_allclose(fresh.run(tf.reduce_sum(w)), 15.0)


def test_restore_writes_into_the_existing_buffers(tmp_path):
    sess, variables = _model()
    saver = Saver(variables)
    path = saver.save(sess, tmp_path / "m.npz")
    held = sess.variables[variables[0]]
    held[...] = -7.0
    saver.restore(sess, path)
    assert sess.variables[variables[0]] is held  # compiled programs may keep it
    np.testing.assert_array_equal(held, np.arange(6).reshape(2, 3))


def test_default_var_list_and_dict_names(tmp_path):
    sess, variables = _model()
    everything = Saver()
    assert set(variables) <= set(everything.variables.values())
    renamed = Saver({"weights": variables[0]})
    path = renamed.save(sess, tmp_path / "renamed.npz")
    assert list(read_checkpoint(path)) == ["weights"]


def test_file_is_plain_npz_with_a_json_manifest_and_no_pickle(tmp_path, monkeypatch):
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "m.npz")
    with np.load(path, allow_pickle=False) as archive:  # loads without pickle
        manifest = json.loads(archive["__manifest__"].tobytes())
        assert all(not archive[k].dtype.hasobject for k in archive.files)
    assert manifest["format"] == "tinyflow.checkpoint" and manifest["version"] == 1
    assert manifest["names"] == ["ck_w", "ck_b", "ck_step"]
    assert manifest["shapes"] == [[2, 3], [2], []]
    assert manifest["dtypes"] == ["float32", "float64", "float32"]

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    Saver(variables).restore(tf.Session(), path)


def test_a_pickle_file_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "evil.npz"
    evil.write_bytes(pickle.dumps(Payload()))
    sess, variables = _model()
    with pytest.raises(CheckpointError, match="not a TinyFlow checkpoint"):
        Saver(variables).restore(sess, evil)
    assert not marker.exists()


def test_an_object_array_inside_an_npz_is_refused(tmp_path):
    sess, variables = _model()
    path = tmp_path / "objects.npz"
    np.savez(path, __manifest__=np.frombuffer(b"{}", np.uint8),
             v0=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match="objects.npz"):
        Saver(variables).restore(sess, path)


@pytest.mark.parametrize("damage", ["truncate", "flip_bytes", "empty", "garbage"])
def test_corrupt_or_truncated_files_give_a_checkpoint_error(tmp_path, damage):
    sess, variables = _model()
    path = Path(Saver(variables).save(sess, tmp_path / "m.npz"))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip_bytes":
        # Damage the first stored array's bytes (after its local header): the zip's
        # CRC check catches it when the member is read.
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo("v0.npy")
        start = info.header_offset + 30 + len(info.filename) + 140
        for i in range(start, start + 8):
            data[i] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a checkpoint at all" * 10)
    path.write_bytes(bytes(data))
    before = {v: sess.variables[v].copy() for v in variables}
    with pytest.raises(CheckpointError, match="m.npz"):
        Saver(variables).restore(sess, path)
    for var in variables:  # nothing was changed
        np.testing.assert_array_equal(sess.variables[var], before[var])


def test_missing_file_and_missing_manifest(tmp_path):
    sess, variables = _model()
    with pytest.raises(CheckpointError, match="does not exist"):
        Saver(variables).restore(sess, tmp_path / "nothing.npz")
    plain = tmp_path / "plain.npz"
    np.savez(plain, ck_w=np.zeros((2, 3), np.float32))
    with pytest.raises(CheckpointError, match="no __manifest__"):
        Saver(variables).restore(sess, plain)


def test_missing_variable_is_named(tmp_path):
    sess, variables = _model()
    path = Saver(variables[:1]).save(sess, tmp_path / "partial.npz")
    with pytest.raises(CheckpointError, match=r"'ck_b'.*missing"):
        Saver(variables).restore(sess, path)
    Saver(variables[:1]).restore(sess, path)  # the subset it holds restores fine


def test_shape_mismatch_names_variable_and_both_shapes_and_changes_nothing(tmp_path):
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "m.npz")
    other_w = tf.Variable(np.zeros((3, 2), np.float32), name="ck_w")
    other_b = tf.Variable(np.zeros(2), name="ck_b", dtype=np.float64)
    other = tf.Session()
    other.run(tf.global_variables_initializer())
    with pytest.raises(CheckpointError) as err:
        Saver([other_b, other_w]).restore(other, path)
    message = str(err.value)
    assert "'ck_w'" in message and "(2, 3)" in message and "(3, 2)" in message
    # ck_b matched but was not written: a failed restore changes nothing.
    np.testing.assert_array_equal(other.variables[other_b], np.zeros(2))


def test_dtype_mismatch_is_refused(tmp_path):
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "m.npz")
    as_float32 = tf.Variable(np.zeros(2, np.float32), name="ck_b")
    with pytest.raises(CheckpointError, match=r"'ck_b'.*float64.*float32"):
        Saver([as_float32]).restore(tf.Session(), path)


def test_saver_refuses_duplicate_names_and_uninitialized_variables(tmp_path):
    a = tf.Variable(np.zeros(2, np.float32), name="same")
    b = tf.Variable(np.zeros(2, np.float32), name="same")
    with pytest.raises(CheckpointError, match="both named 'same'"):
        Saver([a, b])
    with pytest.raises(CheckpointError, match="no value"):
        Saver([a]).save(tf.Session(), tmp_path / "x.npz")


def test_save_is_atomic(tmp_path, monkeypatch):
    sess, variables = _model()
    saver = Saver(variables)
    path = Path(saver.save(sess, tmp_path / "m.npz"))
    good = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")
    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(KeyboardInterrupt):
        saver.save(sess, path)
    assert path.read_bytes() == good          # the old checkpoint is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz"]  # no temp file left


def test_saved_file_has_ordinary_permissions(tmp_path):
    sess, variables = _model()
    umask = os.umask(0o022)
    try:
        path = Saver(variables).save(sess, tmp_path / "m.npz")
    finally:
        os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o644  # not mkstemp's private 0600
