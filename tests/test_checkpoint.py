"""Checkpoints (tinyflow/saver.py): round trips, refusals, no pickle, atomic writes.

The file format is safetensors; version-1 `.npz` checkpoints are still read.
"""

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import tinyflow as tf
from tinyflow.saver import CheckpointError, Saver, read_checkpoint, read_metadata


def _model():
    """Three Variables of different shapes and dtypes, initialized in a Session."""
    w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="ck_w")
    b = tf.Variable(np.array([0.5, -1.5]), name="ck_b", dtype=np.float64)
    step = tf.Variable(np.zeros((), np.float32), name="ck_step", trainable=False)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    return sess, [w, b, step]


def _write_v1_npz(path, names_arrays):
    """A checkpoint as TinyFlow 0.1 wrote it: np.savez of v0.. plus a JSON manifest."""
    names = [n for n, _ in names_arrays]
    arrays = [a for _, a in names_arrays]
    manifest = {"format": "tinyflow.checkpoint", "version": 1, "names": names,
                "shapes": [list(a.shape) for a in arrays],
                "dtypes": [a.dtype.name for a in arrays]}
    entries = {f"v{i}": a for i, a in enumerate(arrays)}
    entries["__manifest__"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    np.savez(path, **entries)
    return manifest


def test_round_trip_restores_values_shapes_and_dtypes(tmp_path):
    sess, variables = _model()
    w, b, step = variables
    sess.run(tf.assign(step, step + 3.0))
    saver = Saver(variables)
    path = saver.save(sess, tmp_path / "model.safetensors")
    assert Path(path) == tmp_path / "model.safetensors"

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
    path = saver.save(sess, tmp_path / "m.safetensors")
    held = sess.variables[variables[0]]
    held[...] = -7.0
    saver.restore(sess, path)
    assert sess.variables[variables[0]] is held  # compiled programs may keep it
    np.testing.assert_array_equal(held, np.arange(6).reshape(2, 3))


def test_restore_copies_the_file_only_into_the_variables(tmp_path):
    """Issue 22: restore read the whole file into memory and copied the tensors out of
    it before writing the Variables (twice the checkpoint's size allocated); now the
    file is mapped, checked in place, and each tensor copied once, into its buffer."""
    import tracemalloc
    big = tf.Variable(np.ones((512, 1024), np.float32), name="ck_big")  # 2 MiB
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    saver = Saver([big])
    path = saver.save(sess, tmp_path / "big.safetensors")
    sess.variables[big][...] = 0.0
    tracemalloc.start()  # numpy reports its allocations to tracemalloc too
    try:
        saver.restore(sess, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**18, f"restore allocated {peak} bytes for a 2 MiB checkpoint"
    np.testing.assert_array_equal(sess.variables[big], 1.0)


def test_a_file_that_cannot_be_mapped_is_read(tmp_path, monkeypatch):
    import mmap
    sess, variables, path = _saved(tmp_path)
    expected = {v: sess.variables[v].copy() for v in variables}

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap says on some file systems
    monkeypatch.setattr(mmap, "mmap", refuse)
    fresh = tf.Session()
    Saver(variables).restore(fresh, path)
    for var in variables:
        np.testing.assert_array_equal(fresh.variables[var], expected[var])


def test_default_var_list_and_dict_names(tmp_path):
    sess, variables = _model()
    everything = Saver()
    assert set(variables) <= set(everything.variables.values())
    renamed = Saver({"weights": variables[0]})
    path = renamed.save(sess, tmp_path / "renamed.safetensors")
    assert list(read_checkpoint(path)) == ["weights"]


def test_file_is_safetensors_with_tinyflow_metadata_and_no_pickle(tmp_path, monkeypatch):
    import safetensors.numpy
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "m.safetensors", global_step=12)
    tensors = safetensors.numpy.load_file(path)  # the library's own reader opens it
    assert sorted(tensors) == ["ck_b", "ck_step", "ck_w"]
    assert tensors["ck_w"].dtype == np.float32 and tensors["ck_w"].shape == (2, 3)
    assert tensors["ck_b"].dtype == np.float64 and tensors["ck_step"].shape == ()
    meta = read_metadata(path)
    assert meta["format"] == "tinyflow.checkpoint" and meta["version"] == "3"
    assert meta["tinyflow_version"] == tf.__version__ and meta["step"] == "12"
    assert len(meta["crc32"]) == 8 and "sha256" not in meta

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    Saver(variables).restore(tf.Session(), path)


def test_version_1_npz_checkpoints_still_restore(tmp_path):
    sess, variables = _model()
    old = tmp_path / "old.npz"
    _write_v1_npz(old, [(v.name, sess.variables[v] + 1) for v in variables])
    fresh = tf.Session()
    Saver(variables).restore(fresh, old)
    for var in variables:
        np.testing.assert_array_equal(fresh.variables[var], sess.variables[var] + 1)
    assert read_metadata(old) == {}


@pytest.mark.parametrize("damage", ["shape_1e11", "manifest_types", "manifest_nested",
                                    "header_flip", "compressed"])
def test_crafted_npz_checkpoints_give_a_checkpoint_error(tmp_path, damage):
    """Issue 14 item 18: these escaped as MemoryError, TypeError, RecursionError and
    NotImplementedError from the old zip reader."""
    sess, variables = _model()
    path = tmp_path / "crafted.npz"
    arrays = [(v.name, sess.variables[v]) for v in variables]
    _write_v1_npz(path, arrays)
    data = bytearray(path.read_bytes())
    if damage == "shape_1e11":
        # A member whose .npy header says (100000000000,) but that holds 24 bytes.
        npy = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            npy, {"descr": "<f4", "fortran_order": False, "shape": (10**11,)})
        with zipfile.ZipFile(path) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        members["v0.npy"] = npy.getvalue() + b"\0" * 24
        with zipfile.ZipFile(path, "w") as archive:
            for name, member in members.items():
                archive.writestr(name, member)
        data = bytearray(path.read_bytes())
    elif damage in ("manifest_types", "manifest_nested"):
        manifest = ({"format": "tinyflow.checkpoint", "version": 1, "names": [1, 2, 3],
                     "shapes": "abc", "dtypes": None} if damage == "manifest_types"
                    else "[" * 100_000)
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        np.savez(path, __manifest__=np.frombuffer(text.encode(), np.uint8),
                 v0=np.zeros((2, 3), np.float32))
        data = bytearray(path.read_bytes())
    elif damage == "header_flip":
        central = data.index(b"PK\x01\x02")  # the first member's central directory entry
        data[central + 10] ^= 0xFF  # its compression method
    else:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("v0.npy", b"\0" * 10_000_000)
        data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="crafted.npz"):
        Saver(variables).restore(sess, path)


def test_a_pickle_file_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "evil.npz"
    evil.write_bytes(pickle.dumps(Payload()))
    sess, variables = _model()
    with pytest.raises(CheckpointError, match="evil.npz is not a readable checkpoint"):
        Saver(variables).restore(sess, evil)
    assert not marker.exists()


def test_an_object_array_inside_an_npz_is_refused(tmp_path):
    sess, variables = _model()
    path = tmp_path / "objects.npz"
    np.savez(path, __manifest__=np.frombuffer(b"{}", np.uint8),
             v0=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match="objects.npz.*object"):
        Saver(variables).restore(sess, path)


def _saved(tmp_path, name="m.safetensors"):
    sess, variables = _model()
    path = Path(Saver(variables).save(sess, tmp_path / name))
    return sess, variables, path


def _refused_without_change(sess, variables, path, match):
    before = {v: sess.variables[v].copy() for v in variables}
    with pytest.raises(CheckpointError, match=match):
        Saver(variables).restore(sess, path)
    for var in variables:  # nothing was changed
        np.testing.assert_array_equal(sess.variables[var], before[var])


@pytest.mark.parametrize("fraction", [0.0, 0.003, 0.25, 0.6, 0.99])
def test_a_truncated_checkpoint_gives_a_checkpoint_error(tmp_path, fraction):
    sess, variables, path = _saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])
    _refused_without_change(sess, variables, path, "m.safetensors")


def test_a_flipped_byte_anywhere_gives_a_checkpoint_error(tmp_path):
    sess, variables, path = _saved(tmp_path)
    good = path.read_bytes()
    for offset in range(len(good)):
        data = bytearray(good)
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            read_checkpoint(path)
        except CheckpointError as err:
            assert "m.safetensors" in str(err)
        else:
            raise AssertionError(f"a flipped byte at offset {offset} of {len(good)} was "
                                 "read without complaint")
    path.write_bytes(good)
    _refused_without_change(sess, variables, tmp_path / "empty", "does not exist")


def test_every_single_bit_flip_gives_a_checkpoint_error(tmp_path):
    """Issue 22: the checksum covers the metadata too. A flipped bit in "step" (12 ->
    13), in the "format" value or in the checksum's key ("sha256" -> "sha257") used to
    be read without complaint."""
    sess, variables = _model()
    path = Path(Saver(variables).save(sess, tmp_path / "m.safetensors", global_step=12))
    good = path.read_bytes()
    missed = []
    with open(path, "r+b") as f:  # changed in place: rewriting it is slow on some disks

        def put(offset, byte):
            f.seek(offset)
            f.write(bytes([byte]))
            f.flush()

        for offset, byte in enumerate(good):
            for bit in range(8):
                put(offset, byte ^ (1 << bit))
                try:
                    read_metadata(path)
                except CheckpointError:
                    continue
                missed.append((offset, bit, good[max(0, offset - 8):offset + 8]))
            put(offset, byte)
    assert not missed, f"{len(missed)} flipped bits read without complaint: {missed[:5]}"
    assert read_metadata(path)["step"] == "12"


def test_damaged_data_is_refused_before_any_variable_changes(tmp_path):
    sess, variables, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10  # the last byte of the last tensor's data
    path.write_bytes(bytes(data))
    _refused_without_change(sess, variables, path, "m.safetensors is damaged")


_V2_FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v2_sha256.safetensors"


def test_version_2_sha256_checkpoints_still_restore(tmp_path):
    """The fixture was written by the version-2 Saver (sha256, before issue 22)."""
    sess, variables = _model()
    Saver(variables).restore(sess, _V2_FIXTURE)
    w, b, step = (sess.variables[v] for v in variables)
    np.testing.assert_array_equal(w, np.arange(6).reshape(2, 3) * 1.5)
    np.testing.assert_array_equal(b, [0.5, -1.5])
    assert step.shape == () and float(step) == 7.0
    meta = read_metadata(_V2_FIXTURE)
    assert meta["version"] == "2" and meta["step"] == "12" and len(meta["sha256"]) == 64

    damaged = bytearray(_V2_FIXTURE.read_bytes())
    damaged[-5] ^= 0x01  # a bit of ck_w's data
    (tmp_path / "v2.safetensors").write_bytes(bytes(damaged))
    _refused_without_change(sess, variables, tmp_path / "v2.safetensors",
                            "v2.safetensors is damaged.*sha256")


def test_a_tinyflow_checkpoint_without_its_checksum_is_refused(tmp_path):
    import safetensors.numpy
    for version in ("2", "3"):
        path = tmp_path / f"bare{version}.safetensors"
        safetensors.numpy.save_file({"ck_w": np.zeros((2, 3), np.float32)}, path,
                                    metadata={"format": "tinyflow.checkpoint",
                                              "version": version})
        with pytest.raises(CheckpointError, match=f"bare{version}.safetensors is damaged"):
            read_checkpoint(path)
    # Another writer's file with no checksum is read (PyTorch's save_file writes none).
    path = tmp_path / "foreign.safetensors"
    safetensors.numpy.save_file({"ck_w": np.ones((2, 3), np.float32)}, path,
                                metadata={"format": "pt"})
    np.testing.assert_array_equal(read_checkpoint(path)["ck_w"], np.ones((2, 3)))


def _header_file(path, header, data=b""):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("header", [
    {"w": {"dtype": "F32", "shape": [100_000_000_000], "data_offsets": [0, 24]}},
    {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 400_000_000_000]}},
    {"__metadata__": {"format": 7, "version": [2]}, "w": {"dtype": "F32", "shape": [1],
                                                          "data_offsets": [0, 4]}},
    {"__metadata__": {"format": {"nested": {"deeper": 1}}}},
    {"w": {"dtype": "OBJECT", "shape": [1], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
    {"w": "not a tensor"},
    [1, 2, 3],
    {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
     "v": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}},
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
    {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
    {"__metadata__": None, "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
     "v": {"dtype": "F32", "shape": [], "data_offsets": [24, 28]}},
], ids=["1e11_elements", "offsets_past_end", "metadata_not_strings", "metadata_nested",
        "unknown_dtype", "negative_dim", "entry_not_object", "header_a_list",
        "dtype_a_list", "shape_of_booleans", "one_offset", "overlapping", "gap_before",
        "bytes_left_over", "past_the_end_after_null_metadata"])
def test_crafted_safetensors_headers_give_a_checkpoint_error(tmp_path, header):
    sess, variables = _model()
    path = tmp_path / "crafted.safetensors"
    _header_file(path, header, b"\0" * 24)
    _refused_without_change(sess, variables, path, "crafted.safetensors")


def test_header_length_larger_than_the_file_and_other_formats(tmp_path):
    sess, variables = _model()
    path = tmp_path / "liar.safetensors"
    path.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    _refused_without_change(sess, variables, path, "header claims")
    path.write_bytes(b"not a checkpoint at all" * 10)
    _refused_without_change(sess, variables, path, "liar.safetensors")
    path.write_bytes(b"")
    _refused_without_change(sess, variables, path, "too short")
    _refused_without_change(sess, variables, tmp_path, "is a directory")


def test_a_dtype_numpy_lacks_is_named(tmp_path):
    path = tmp_path / "bf16.safetensors"
    _header_file(path, {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}},
                 b"\0" * 4)
    with pytest.raises(CheckpointError, match="bf16.safetensors: a tensor has dtype 'BF16'"):
        read_checkpoint(path)


def test_a_newer_tinyflow_checkpoint_version_is_refused(tmp_path):
    import safetensors.numpy
    path = tmp_path / "future.safetensors"
    safetensors.numpy.save_file({"ck_w": np.zeros((2, 3), np.float32)}, path,
                                metadata={"format": "tinyflow.checkpoint", "version": "9"})
    with pytest.raises(CheckpointError, match="version '9' is not supported"):
        read_checkpoint(path)


def test_missing_file_and_missing_manifest(tmp_path):
    sess, variables = _model()
    with pytest.raises(CheckpointError, match="does not exist"):
        Saver(variables).restore(sess, tmp_path / "nothing.npz")
    plain = tmp_path / "plain.npz"  # an .npz that TinyFlow did not write
    np.savez(plain, ck_w=np.zeros((2, 3), np.float32))
    with pytest.raises(CheckpointError, match="no __manifest__"):
        Saver(variables).restore(sess, plain)


def test_missing_variable_is_named(tmp_path):
    sess, variables = _model()
    path = Saver(variables[:1]).save(sess, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointError, match=r"'ck_b'.*missing"):
        Saver(variables).restore(sess, path)
    Saver(variables[:1]).restore(sess, path)  # the subset it holds restores fine


def test_shape_mismatch_names_variable_and_both_shapes_and_changes_nothing(tmp_path):
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "m.safetensors")
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
    path = Saver(variables).save(sess, tmp_path / "m.safetensors")
    as_float32 = tf.Variable(np.zeros(2, np.float32), name="ck_b")
    with pytest.raises(CheckpointError, match=r"'ck_b'.*float64.*float32"):
        Saver([as_float32]).restore(tf.Session(), path)


def test_saver_refuses_duplicate_names_and_uninitialized_variables(tmp_path):
    a = tf.Variable(np.zeros(2, np.float32), name="same")
    b = tf.Variable(np.zeros(2, np.float32), name="same")
    with pytest.raises(CheckpointError, match="both named 'same'"):
        Saver([a, b])
    with pytest.raises(CheckpointError, match="no value"):
        Saver([a]).save(tf.Session(), tmp_path / "x.safetensors")


def test_save_is_atomic(tmp_path, monkeypatch):
    sess, variables = _model()
    saver = Saver(variables)
    path = Path(saver.save(sess, tmp_path / "m.safetensors"))
    good = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")
    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        saver.save(sess, path)
    assert path.read_bytes() == good          # the old checkpoint is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temp file left


def test_saved_file_has_ordinary_permissions(tmp_path):
    sess, variables = _model()
    umask = os.umask(0o022)
    try:
        path = Saver(variables).save(sess, tmp_path / "m.safetensors")
    finally:
        os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o644  # not mkstemp's private 0600


def test_saving_to_a_directory_or_an_unwritable_place_is_a_checkpoint_error(tmp_path):
    """Issue 14 item 18: these were raw IsADirectoryError / FileNotFoundError."""
    sess, variables = _model()
    saver = Saver(variables)
    with pytest.raises(CheckpointError, match="is a directory"):
        saver.save(sess, tmp_path)
    with pytest.raises(CheckpointError, match="is a directory"):
        saver.save(sess, "")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="a_file"):
        saver.save(sess, blocker / "model.safetensors")


_KILLED_SAVE = """
import os, signal, sys
import numpy as np
import tinyflow as tf
from tinyflow.saver import Saver
w = tf.Variable(np.full((4, 4), float(sys.argv[2]), np.float32), name="w")
sess = tf.Session()
sess.run(tf.global_variables_initializer())
if sys.argv[3] == "kill":  # die the hard way once the new bytes are written
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
Saver([w]).save(sess, sys.argv[1])
"""


def test_sigkill_mid_save_keeps_the_old_checkpoint_and_the_next_save_cleans_up(tmp_path):
    """Issue 14 item 18: a killed writer left `.NAME.*.tmp` files forever."""
    target = tmp_path / "w.safetensors"
    env = dict(os.environ, PYTHONPATH=str(Path(tf.__file__).parents[1]))

    def save(value, mode):
        return subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(target), str(value),
                               mode], env=env, capture_output=True, timeout=120)

    assert save(1.0, "ok").returncode == 0
    killed = save(2.0, "kill")
    assert killed.returncode == -signal.SIGKILL
    np.testing.assert_array_equal(read_checkpoint(target)["w"], np.ones((4, 4)))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".w.safetensors.")
    assert save(3.0, "ok").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
    np.testing.assert_array_equal(read_checkpoint(target)["w"], np.full((4, 4), 3.0))


def test_pytorch_reads_a_tinyflow_checkpoint_and_tinyflow_reads_pytorchs(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "tf.safetensors")
    loaded = load_file(path)
    for var in variables:
        np.testing.assert_array_equal(loaded[var.name].numpy(), sess.variables[var])
    assert loaded["ck_b"].dtype == torch.float64

    theirs = tmp_path / "torch.safetensors"
    save_file({"ck_w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 10,
               "ck_b": torch.tensor([3.0, 4.0], dtype=torch.float64),
               "ck_step": torch.tensor(5.0)}, str(theirs))
    Saver(variables).restore(sess, theirs)
    np.testing.assert_array_equal(sess.variables[variables[0]],
                                  np.arange(6).reshape(2, 3) * 10)
    assert float(sess.run(variables[2])) == 5.0


# -- regression tests for probes of bad input -------------------------------------------


def test_a_big_endian_variable_saves_a_file_that_restores(tmp_path):
    # Its checksum was taken over big-endian bytes while safetensors wrote
    # little-endian ones: the save replaced a good file with one restore refused.
    v = tf.Variable(np.arange(3, dtype=">f4"), name="be_v")
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    path = Saver([v]).save(sess, tmp_path / "be.safetensors")
    np.testing.assert_array_equal(read_checkpoint(path)["be_v"], [0, 1, 2])
    assert read_checkpoint(path)["be_v"].dtype == np.dtype("<f4")
    sess.run(tf.assign(v, np.full(3, 7, ">f4")))
    Saver([v]).restore(sess, path)
    np.testing.assert_array_equal(sess.run(v), [0, 1, 2])


def test_a_big_endian_npz_member_restores_as_float32(tmp_path):
    sess, variables = _model()
    w = variables[0]
    old = tmp_path / "old.npz"
    big_endian = (np.arange(6) + 1).astype(">f4").reshape(2, 3)  # (arithmetic: native)
    _write_v1_npz(old, [("ck_w", big_endian)])
    Saver([w]).restore(sess, old)
    np.testing.assert_array_equal(sess.variables[w], np.arange(6).reshape(2, 3) + 1)
    assert read_checkpoint(old)["ck_w"].dtype == np.dtype("<f4")


def test_an_npz_with_a_member_twice_is_refused(tmp_path):
    sess, variables = _model()
    path = tmp_path / "twice.npz"
    _write_v1_npz(path, [("ck_w", np.zeros((2, 3), np.float32))])
    with zipfile.ZipFile(path, "a") as archive, pytest.warns(UserWarning):
        archive.writestr("v0.npy", _npy_bytes(np.ones((2, 3), np.float32)))
    _refused_without_change(sess, variables, path, "'v0.npy' appears twice")


def _npy_bytes(array):
    out = io.BytesIO()
    np.lib.format.write_array(out, array)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_path_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    # A FIFO blocked the restore forever; /dev/zero was read without end.
    sess, variables = _model()
    path = "/dev/zero" if kind == "device" else tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
    _refused_without_change(sess, variables, path, "not a regular file")


def test_saver_var_list_that_is_not_variables(tmp_path):
    sess, variables = _model()
    for bad in (["ck_w"], [1], "ck_w", 5):
        with pytest.raises(CheckpointError, match="not a Variable|var_list must be"):
            Saver(bad)
    single = Saver(variables[0])  # one Variable is taken as a list of one
    assert list(single.variables) == ["ck_w"]


@pytest.mark.parametrize("step", ["abc", float("nan"), 1.7, True])
def test_global_step_must_be_a_whole_number(tmp_path, step):
    sess, variables = _model()
    with pytest.raises(CheckpointError, match="global_step must be a whole number"):
        Saver(variables).save(sess, tmp_path / "m.safetensors", global_step=step)
    assert not (tmp_path / "m.safetensors").exists()


def test_global_step_takes_numpy_integers(tmp_path):
    sess, variables = _model()
    path = Saver(variables).save(sess, tmp_path / "m.safetensors", global_step=np.int64(7))
    assert read_metadata(path)["step"] == "7"


def test_a_path_with_nul_and_a_name_with_a_surrogate_are_refused(tmp_path):
    sess, variables = _model()
    with pytest.raises(CheckpointError, match="NUL"):
        Saver(variables).save(sess, str(tmp_path / "m\0.safetensors"))
    with pytest.raises(CheckpointError, match="NUL"):
        Saver(variables).restore(sess, str(tmp_path / "m\0.safetensors"))
    with pytest.raises(CheckpointError, match="UTF-8"):
        Saver({"x\udcffy": variables[0]}).save(sess, tmp_path / "m.safetensors")


def test_a_long_legal_file_name_saves(tmp_path):
    # The temporary name added the pid and mkstemp's suffix: 250 + ~25 > NAME_MAX.
    sess, variables = _model()
    for name in ("x" * 250, "é" * 127):  # 250 and 254 bytes
        path = Saver(variables).save(sess, tmp_path / name)
        assert set(read_checkpoint(path)) == {"ck_w", "ck_b", "ck_step"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["x" * 250, "é" * 127])


def test_a_stale_temporary_of_a_name_with_glob_characters_is_removed(tmp_path):
    sess, variables = _model()
    stale = tmp_path / ".m[1].safetensors.999999999.abcd.tmp"  # no such pid
    stale.write_bytes(b"half a file")
    Saver(variables).save(sess, tmp_path / "m[1].safetensors")
    assert not stale.exists()


def test_saving_under_a_file_names_the_file(tmp_path):
    sess, variables = _model()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="afile .* is a file, not a folder"):
        Saver(variables).save(sess, tmp_path / "afile" / "m.safetensors")


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(),
                    reason="runs a child as nobody: needs root and setpriv")
def test_a_folder_that_cannot_be_entered_gives_a_checkpoint_error():
    # path.is_dir() raised a bare PermissionError for a folder of mode 000.
    import shutil
    import tempfile
    import tinyflow
    outer = Path(tempfile.mkdtemp(prefix="tinyflow-closed-"))  # pytest's tmp is 0700
    closed = outer / "closed"
    try:
        outer.chmod(0o755)
        closed.mkdir()
        sess, variables = _model()
        Saver(variables).save(sess, closed / "m.safetensors")
        closed.chmod(0o000)
        script = (
            "import numpy as np, sys, tinyflow as tf\n"
            "v = tf.Variable(np.ones(3, np.float32), name='v')\n"
            "s = tf.Session(); s.run(tf.global_variables_initializer())\n"
            "for act in ('save', 'restore'):\n"
            "    try:\n"
            "        getattr(tf.train.Saver([v]), act)(s, sys.argv[1])\n"
            "    except tf.TinyFlowError as e:\n"
            "        print(act, type(e).__name__, e)\n")
        env = dict(os.environ, PYTHONPATH=str(Path(tinyflow.__file__).parents[1]))
        done = subprocess.run(
            ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, "-c", script, str(closed / "m.safetensors")],
            capture_output=True, text=True, timeout=60, cwd="/", env=env)
    finally:
        closed.chmod(0o755)
        shutil.rmtree(outer)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("save CheckpointError") and "Permission denied" in lines[0]
    assert lines[1].startswith("restore CheckpointError") and "Permission denied" in lines[1]
