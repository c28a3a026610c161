"""Task validation and the safe npz reader: each bad input gets its own clear error."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from learner.errors import ArchiveError, ArchiveMemberError, ArchiveTooLargeError, InputError
from learner.taskio import Limits, load_task, read_npz, task_to_npz_bytes, validate_task

from .helpers import small_task


def arrays(n=5, m=3):
    rng = np.random.default_rng(0)
    return {
        "train_images": rng.random((n, 1, 9, 9), dtype=np.float32),
        "train_labels": rng.integers(0, 10, n).astype(np.int64),
        "test_images": rng.random((m, 1, 9, 9), dtype=np.float32),
    }


def npz_bytes(members: dict, compressed=False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **members)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name, value, fragment",
    [
        ("train_images", lambda a: a["train_images"].astype(np.float64), "train_images must have dtype float32, got float64"),
        ("test_images", lambda a: a["test_images"].reshape(3, 81), "test_images must have shape (N, 1, 9, 9), got (3, 81)"),
        ("train_images", lambda a: a["train_images"].reshape(5, 1, 81, 1), "train_images must have shape (N, 1, 9, 9)"),
        ("train_images", lambda a: np.zeros((0, 1, 9, 9), np.float32), "train_images must hold at least one image"),
        ("test_images", lambda a: np.zeros((0, 1, 9, 9), np.float32), "test_images must hold at least one image"),
        ("train_images", lambda a: np.where(np.arange(405).reshape(5, 1, 9, 9) == 7, np.nan, a["train_images"]).astype(np.float32), "train_images holds 1 non-finite pixel value"),
        ("test_images", lambda a: np.full((3, 1, 9, 9), np.inf, np.float32), "test_images holds 243 non-finite"),
        ("train_images", lambda a: a["train_images"] * 255, "train_images pixels must lie in [0, 1]"),
        ("test_images", lambda a: a["test_images"] - 0.5, "test_images pixels must lie in [0, 1]"),
        ("train_labels", lambda a: a["train_labels"].astype(np.float32), "train_labels must have an integer dtype, got float32"),
        ("train_labels", lambda a: np.array([0, 1, 2, 3, 10]), "train_labels must be in 0..9, found min 0 and max 10"),
        ("train_labels", lambda a: np.array([0, 1, -1, 3, 4]), "train_labels must be in 0..9, found min -1"),
        ("train_labels", lambda a: a["train_labels"][:4], "train_labels has 4 labels but train_images has 5 images"),
        ("train_labels", lambda a: a["train_labels"].reshape(5, 1), "train_labels must have shape (N,), got (5, 1)"),
        ("train_labels", lambda a: a["train_labels"].astype(bool), "train_labels must have an integer dtype, got bool"),
    ],
)
def test_each_bad_array_is_named(name, value, fragment):
    a = arrays()
    a[name] = value(a)
    with pytest.raises(InputError) as err:
        validate_task(**a)
    assert fragment in str(err.value)
    assert err.value.details["array"] == name


def test_good_task_roundtrip_and_label_dtypes():
    a = arrays()
    a["train_labels"] = a["train_labels"].astype(np.uint8)
    task = load_task(npz_bytes(a, compressed=True))
    assert task.train_labels.dtype == np.int64
    np.testing.assert_array_equal(task.train_images, a["train_images"])
    big_endian = a["train_images"].astype(">f4")
    a["train_images"] = big_endian
    with pytest.raises(InputError, match="dtype float32"):
        load_task(npz_bytes(a))  # >f4 is not float32 in numpy's eyes: be explicit


def test_query_labels_member_rejected_with_reason():
    a = arrays()
    a["test_labels"] = np.zeros(3, np.int64)
    with pytest.raises(ArchiveMemberError) as err:
        read_npz(npz_bytes(a))
    msg = str(err.value)
    assert "'test_labels.npy'" in msg and "query/test labels must never be uploaded" in msg


@pytest.mark.parametrize("extra", ["notes", "y_query", "train_images_copy"])
def test_any_other_member_rejected(extra):
    a = arrays()
    a[extra] = np.zeros(1)
    with pytest.raises(ArchiveMemberError, match=f"'{extra}.npy'"):
        read_npz(npz_bytes(a))


def test_missing_member():
    a = arrays()
    del a["test_images"]
    with pytest.raises(ArchiveMemberError, match="missing member.*test_images.npy.*rev88 make-task"):
        read_npz(npz_bytes(a))


def test_not_a_zip_and_truncated(tmp_path):
    """Something else than an npz: the refusal says what a task holds and how to make one, and
    names a file by its path (an upload as "the upload")."""
    with pytest.raises(ArchiveError, match="not a zip/npz") as refused:
        read_npz(b"hello, this is not an archive")
    said = refused.value.message
    assert said.startswith("the upload is not a zip/npz archive")
    for words in ("train_images", "train_labels", "test_images", "rev88 make-task"):
        assert words in said, said
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ArchiveError) as refused:
        read_npz(notes)
    assert refused.value.message.startswith(f"{notes} is not a zip/npz archive") and "body" not in refused.value.message
    data = npz_bytes(arrays(200, 50))
    with pytest.raises(ArchiveError):
        read_npz(data[: len(data) // 2])
    with pytest.raises(ArchiveError):
        read_npz(b"")


def test_corrupt_member_crc():
    data = bytearray(npz_bytes(arrays()))
    # Flip a byte inside the first member's array data (after its local header + npy header).
    data[300] ^= 0xFF
    with pytest.raises(ArchiveError):
        read_npz(bytes(data))


def test_pickled_object_array_never_loaded():
    a = arrays()
    buf = io.BytesIO()
    obj = np.empty(5, dtype=object)
    obj[:] = [1, 2, 3, 4, 5]
    np.savez(buf, train_images=a["train_images"], train_labels=obj, test_images=a["test_images"])
    with pytest.raises(InputError, match="object dtype.*no pickles"):
        read_npz(buf.getvalue())


def _npz_with_header(shape, dtype="<f4", payload=b"") -> bytes:
    a = arrays()
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("train_labels.npy", _npy(a["train_labels"]))
        zf.writestr("test_images.npy", _npy(a["test_images"]))
        raw = io.BytesIO()
        np.lib.format.write_array_header_1_0(raw, header)
        zf.writestr("train_images.npy", raw.getvalue() + payload)
    return out.getvalue()


def _npy(arr) -> bytes:
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def test_header_shape_too_large_checked_before_reading():
    with pytest.raises(ArchiveTooLargeError, match="rows, limit"):
        read_npz(_npz_with_header((10**9, 1, 9, 9)))


def test_header_disagreeing_with_member_size():
    with pytest.raises(ArchiveError, match="header says shape"):
        read_npz(_npz_with_header((5, 1, 9, 9), payload=b"\0" * 16))


def test_declared_sizes_and_ratio_limits():
    a = arrays(4000, 10)  # 1.3 MB of images: the ratio check applies to members over 1 MiB
    a["train_images"] = np.zeros_like(a["train_images"])  # compresses extremely well
    data = npz_bytes(a, compressed=True)
    with pytest.raises(ArchiveTooLargeError, match="compression ratio"):
        read_npz(data, Limits(max_ratio=5.0))
    with pytest.raises(ArchiveTooLargeError, match="declares .* uncompressed bytes"):
        read_npz(data, Limits(max_member_bytes=1000))
    with pytest.raises(ArchiveTooLargeError, match="archive declares"):
        read_npz(data, Limits(max_total_bytes=1000, max_ratio=1e9))


def test_too_many_members_named():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for i in range(50):
            zf.writestr(f"m{i}.npy", b"x")
    with pytest.raises(ArchiveMemberError, match="not allowed"):
        read_npz(out.getvalue())


def test_header_size_bounded():
    with pytest.raises(ArchiveError, match="header"):
        read_npz(_npz_with_header((5, 1, 9, 9)), Limits(max_header_size=10))


def test_cli_rejects_labels_archive_with_status_2(tmp_path):
    a = arrays()
    a["test_labels"] = np.zeros(3, np.int64)
    path = tmp_path / "bad.npz"
    path.write_bytes(npz_bytes(a))
    r = subprocess.run([sys.executable, "-m", "rev88", "run", "--input", str(path), "--backend", "cpu",
                        "--output", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "query/test labels must never be uploaded" in r.stderr
    assert not (tmp_path / "r.json").exists()


def test_cli_bad_config_and_bad_array_status_2(tmp_path):
    good = tmp_path / "t.npz"
    good.write_bytes(task_to_npz_bytes(small_task()))
    cfg = tmp_path / "c.json"
    cfg.write_text('{"depth": 0}')
    r = subprocess.run([sys.executable, "-m", "rev88", "run", "--input", str(good), "--config", str(cfg),
                        "--output", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "config.depth must be > 0" in r.stderr
    a = arrays()
    a["train_images"] = a["train_images"] * 2
    bad = tmp_path / "b.npz"
    bad.write_bytes(npz_bytes(a))
    r = subprocess.run([sys.executable, "-m", "rev88", "run", "--input", str(bad), "--output",
                        str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "train_images pixels must lie in [0, 1]" in r.stderr


# --------------------------------------------------------------------------- the fast reader


def test_stored_members_read_from_every_kind_of_source(tmp_path):
    """Bytes, bytearray, memoryview, a path and a file object give np.load's arrays; each
    is aligned, writable, C-contiguous and its own memory (never a view of the caller's
    buffer, so changing that buffer afterwards changes nothing)."""
    a = arrays(7, 4)
    a["train_labels"] = a["train_labels"].astype(np.int32)
    data = npz_bytes(a)
    path = tmp_path / "t.npz"
    path.write_bytes(data)
    buffer = bytearray(data)
    sources = [data, buffer, memoryview(data), str(path), path, io.BytesIO(data)]
    for source in sources:
        got = read_npz(source)
        for name, want in a.items():
            arr = got[name]
            assert arr.dtype == want.dtype and arr.shape == want.shape
            np.testing.assert_array_equal(arr, want)
            assert arr.flags.aligned and arr.flags.writeable and arr.flags.c_contiguous
    kept = read_npz(buffer)
    buffer[:] = b"\0" * len(buffer)
    np.testing.assert_array_equal(kept["train_images"], a["train_images"])


def test_fortran_ordered_and_compressed_members():
    a = arrays(6, 2)
    fortran = np.asfortranarray(a["train_images"])
    got = read_npz(npz_bytes({**a, "train_images": fortran}))
    np.testing.assert_array_equal(got["train_images"], a["train_images"])
    assert got["train_images"].flags.c_contiguous
    got = read_npz(npz_bytes(a, compressed=True))
    np.testing.assert_array_equal(got["test_images"], a["test_images"])


def _members(data: bytes) -> dict[str, zipfile.ZipInfo]:
    return {i.filename: i for i in zipfile.ZipFile(io.BytesIO(data)).infolist()}


def _data_start(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes (its .npy) begin: after its local header, name and extra field."""
    name_length, extra_length = struct.unpack_from("<2H", data, info.header_offset + 26)
    return info.header_offset + 30 + name_length + extra_length


def test_stored_member_crc_checked_in_memory_and_from_a_file(tmp_path):
    data = npz_bytes(arrays())
    info = _members(data)["test_images.npy"]
    bad = bytearray(data)
    bad[_data_start(data, info) + 128 + 5] ^= 0x01  # one bit of a pixel (after the 128-byte .npy header)
    path = tmp_path / "bad.npz"
    path.write_bytes(bytes(bad))
    for source in (bytes(bad), path):
        with pytest.raises(ArchiveError, match="test_images is corrupt: bad CRC-32"):
            read_npz(source)


def test_stored_member_local_header_checked():
    data = npz_bytes(arrays())
    info = _members(data)["train_labels.npy"]
    renamed = bytearray(data)
    at = info.header_offset + 30
    renamed[at : at + 5] = b"XXXXX"  # the local header's name, not the directory's
    with pytest.raises(ArchiveError, match="local header names 'XXXXX_labels.npy'"):
        read_npz(bytes(renamed))
    unsigned = bytearray(data)
    unsigned[info.header_offset : info.header_offset + 4] = b"PK\x09\x09"
    with pytest.raises(ArchiveError, match="bad local file header"):
        read_npz(bytes(unsigned))


def test_stored_member_data_past_the_end_is_truncated():
    """A directory that points past the end of the body: truncated, never read out of bounds."""
    data = npz_bytes(arrays(200, 50))
    info = _members(data)["test_images.npy"]
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        directory_at = zf.start_dir
    cut = data[: info.header_offset + 200] + data[directory_at:]  # the member's data cut short
    # the directory's offsets are now off by the cut; zipfile corrects for prepended data only,
    # so any of "truncated", "corrupt" or "not a zip" is a fine answer -- an ArchiveError
    with pytest.raises(ArchiveError):
        read_npz(cut)


# --------------------------------------------------------------------------- one-pass validation


@pytest.mark.parametrize(
    "value, ok",
    [
        (0.0, True),
        (-0.0, True),  # -0.0 >= 0: accepted, as the exact checks always did
        (1.0, True),
        (np.float32(np.nextafter(np.float32(1), np.float32(2))), False),
        (np.float32(np.nextafter(np.float32(0), np.float32(-1))), False),  # the smallest negative denormal
        (np.float32(1e-45), True),  # the smallest positive denormal
        (np.inf, False),
        (-np.inf, False),
        (np.nan, False),
        (-np.nan, False),
    ],
)
def test_one_pass_range_check_matches_the_exact_rule(value, ok):
    a = arrays()
    a["test_images"] = a["test_images"].copy()
    a["test_images"][1, 0, 4, 4] = value
    if ok:
        validate_task(**a)
        return
    with pytest.raises(InputError, match="test_images (holds 1 non-finite|pixels must lie in)"):
        validate_task(**a)


def test_non_contiguous_images_validated_and_made_contiguous():
    a = arrays(10, 3)
    strided = a["train_images"][::2]
    labels = a["train_labels"][::2]
    task = validate_task(strided, labels, a["test_images"])
    assert task.train_images.flags.c_contiguous
    np.testing.assert_array_equal(task.train_images, strided)
    bad = a["train_images"].copy()
    bad[2, 0, 0, 0] = 2.0
    with pytest.raises(InputError, match="pixels must lie in"):
        validate_task(bad[::2], labels, a["test_images"])


# --------------------------------------------------------------------------- input hashes, once


def test_input_hashes_computed_once_by_load_task_and_equal_to_array_sha256(monkeypatch):
    import learner.taskio as taskio
    from learner.hashing import array_sha256

    a = arrays()
    calls = []
    real = taskio.array_sha256
    monkeypatch.setattr(taskio, "array_sha256", lambda arr: calls.append(1) or real(arr))
    task = load_task(npz_bytes(a))
    assert len(calls) == 3  # computed while loading: in the service, in the parse thread
    first = task.input_hashes()
    second = task.input_hashes()
    assert len(calls) == 3
    assert first == second == {name: array_sha256(arr) for name, arr in a.items() if name != "train_labels"} | {
        "train_labels": array_sha256(a["train_labels"].astype(np.int64))}
    first["train_images"] = "changed"  # a fresh dict each call: the cache cannot be edited through it
    assert task.input_hashes() == second
    assert list(first) == ["train_images", "train_labels", "test_images"]


def test_input_hashes_computed_once_when_threads_ask_at_the_same_time(monkeypatch):
    """The service starts a synchronous task's hashes in a thread of their own while its run may
    already ask for them: whichever comes second waits for the first and nothing is hashed twice."""
    import threading

    import learner.taskio as taskio

    a = arrays()
    task = load_task(npz_bytes(a), hash_inputs=False)
    assert task._input_hashes is None
    inside, release, calls = threading.Event(), threading.Event(), []
    real = taskio.array_sha256

    def slow(arr):
        calls.append(1)
        inside.set()
        release.wait(30)  # held until the second caller is waiting (no sleep, no timing)
        return real(arr)

    monkeypatch.setattr(taskio, "array_sha256", slow)
    got = []
    first = threading.Thread(target=lambda: got.append(task.input_hashes()))
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=lambda: got.append(task.input_hashes()))
    second.start()
    second.join(0.2)
    assert second.is_alive() and len(got) == 0  # waiting for the first thread's hashes
    release.set()
    first.join(30)
    second.join(30)
    assert len(calls) == 3 and len(got) == 2 and got[0] == got[1]


def test_validated_task_hashes_on_first_use_and_result_reuses_them():
    from learner.config import Config
    from learner.hashing import array_sha256
    from learner.result import run_task

    task = small_task()
    assert task._input_hashes is None  # validate_task alone computes nothing
    result = run_task(task, Config(epochs=1), "cpu")
    want = {name: array_sha256(arr) for name, arr in task.as_dict().items()}
    assert result.metadata["input_hashes"] == want == task.input_hashes()
    assert result.metadata["input_hashes"] is not task._input_hashes


def test_array_sha256_is_the_sha256_of_tobytes():
    import hashlib

    from learner.hashing import array_sha256

    rng = np.random.default_rng(3)
    cases = [
        rng.random((4, 1, 9, 9), dtype=np.float32),
        rng.random((4, 1, 9, 9), dtype=np.float32)[::2],  # not contiguous
        rng.integers(0, 10, 7).astype(">i8"),  # big-endian: hashed as little-endian
        np.zeros((0, 1, 9, 9), np.float32),
        np.float64(2.5),
        np.array([True, False]),
        np.asfortranarray(rng.random((3, 5))),
    ]
    for arr in cases:
        le = np.ascontiguousarray(np.asarray(arr).astype(np.asarray(arr).dtype.newbyteorder("<")))
        assert array_sha256(arr) == hashlib.sha256(le.tobytes()).hexdigest()


@pytest.mark.parametrize("array", [
    np.zeros((50, 1, 9, 9), np.float32), np.zeros(7, np.int64), np.zeros(0, np.int32), np.array(3.0),
    np.zeros((3, 4), np.float64, order="F"), np.zeros((2,), ">i4"), np.zeros(5, bool), np.zeros((1, 0, 3), np.uint8),
    np.zeros(3, "U4"), np.zeros(2, [("a", "<i4")]),
])
def test_the_saved_header_fast_path_reads_what_numpy_reads(array):
    """np.save's own header form is parsed without literal_eval; anything else falls back to
    numpy's reader with the file where it was. Either way: numpy's shape, dtype and order."""
    from learner.taskio import DEFAULT_LIMITS, _saved_header

    buf = io.BytesIO()
    np.save(buf, array)
    buf.seek(0)
    fast, after = _saved_header(buf, DEFAULT_LIMITS), buf.tell()
    buf.seek(0)
    version = np.lib.format.read_magic(buf)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(buf)
    if fast is None:
        assert after == 0 and array.dtype.kind in "UV"  # fell back, nothing consumed
    else:
        assert fast == (shape, dtype, fortran) and after == buf.tell()
