"""Reading and checking tasks: the safe npz reader, array validation, npz writing,
MNIST idx reading and the MNIST-medium draw protocol (``make-task``).

The npz reader never unpickles and never decompresses an array before its
member list, declared sizes, compression ratios and ``.npy`` header
(shape x dtype) have been checked against limits.

A stored (uncompressed, as ``np.savez`` writes) member is located through its local header and
read straight from the body (bytes or any buffer); its CRC-32 is checked and its bytes are copied
once, into the final aligned array (zipfile's stream read made several copies). The images are
checked in one integer pass, and the input hashes are computed once, by ``load_task``, and kept
on the ``TaskArrays``. What it costs: docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import re
import struct
import threading
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

try:  # the zip CRC-32: zlib-ng's is about 4x zlib's speed (docs/performance.md); the values are the same
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a machine without the zlib-ng wheel (the lent GPU's image) reads tasks all the same
    from zlib import crc32

from .data import MNIST_SHA256, bundled_mnist_dir, official_name
from .errors import ArchiveError, ArchiveMemberError, ArchiveTooLargeError, InputError
from .hashing import array_sha256

ALLOWED_MEMBERS = ("train_images", "train_labels", "test_images")
IMAGE_SHAPE = (1, 9, 9)
LABEL_WORDS = ("label", "target", "answer", "truth", "query_y", "test_y", "y_test")
# What a task is, in the words a refusal of something else quotes
TASK_FORMAT = ("a task is an npz archive (numpy.savez) of exactly three arrays: train_images float32 (N, 1, 9, 9) "
               "with pixels in [0, 1], train_labels integers 0-9 (N,) and test_images float32 (M, 1, 9, 9); "
               "`rev88 make-task` writes one from the MNIST files")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds checked before any array is decompressed."""

    max_members: int = 3
    max_member_bytes: int = 256 * 1024 * 1024  # declared uncompressed size of one member
    max_total_bytes: int = 512 * 1024 * 1024  # declared uncompressed size of all members
    max_ratio: float = 200.0  # uncompressed / compressed, per member (only if compressed)
    max_examples: int = 1_000_000  # N and M each
    max_header_size: int = 1024  # bytes of a .npy header


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class TaskArrays:
    """A validated task: C-contiguous arrays in their checked dtypes.

    The arrays are not to be modified once the task exists: its input hashes are computed
    once (``input_hashes``) and kept."""

    train_images: np.ndarray  # (N,1,9,9) float32
    train_labels: np.ndarray  # (N,) int64
    test_images: np.ndarray  # (M,1,9,9) float32
    _input_hashes: dict[str, str] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _hashing: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @property
    def train_count(self) -> int:
        return int(self.train_images.shape[0])

    @property
    def test_count(self) -> int:
        return int(self.test_images.shape[0])

    @property
    def shape_key(self) -> tuple[int, int]:
        return (self.train_count, self.test_count)

    def as_dict(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ALLOWED_MEMBERS}

    def input_hashes(self) -> dict[str, str]:
        """``{array name: learner.hashing.array_sha256}`` of the three arrays, the values the
        result metadata records as ``input_hashes``. Computed on the first call (``load_task``
        makes it, unless told not to: the service starts it in a thread of its own beside the
        run) and kept; a call while another thread computes them waits for that one. Each
        call returns a fresh dict."""
        if self._input_hashes is None:
            with self._hashing:
                if self._input_hashes is None:
                    hashes = {name: array_sha256(arr) for name, arr in self.as_dict().items()}
                    object.__setattr__(self, "_input_hashes", hashes)  # frozen: set once, here only
        return dict(self._input_hashes)


# --------------------------------------------------------------------------- validation


def _check_images(name: str, arr: np.ndarray) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{name} must be a numpy array, got {type(arr).__name__}", array=name)
    if arr.dtype != np.float32:
        raise InputError(f"{name} must have dtype float32, got {arr.dtype}", array=name)
    if arr.ndim != 4 or arr.shape[1:] != IMAGE_SHAPE:
        raise InputError(
            f"{name} must have shape (N, 1, 9, 9), got {tuple(arr.shape)}", array=name
        )
    if arr.shape[0] < 1:
        raise InputError(f"{name} must hold at least one image, got 0", array=name)
    if not _pixels_in_unit_range(arr):
        # the slow path, only for a task that fails the one-pass check (or holds -0.0)
        if not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr)).sum())
            raise InputError(f"{name} holds {bad} non-finite pixel value(s) (NaN or inf)", array=name)
        lo, hi = float(arr.min()), float(arr.max())
        if lo < 0.0 or hi > 1.0:
            raise InputError(
                f"{name} pixels must lie in [0, 1], found min {lo!r} and max {hi!r}", array=name
            )
    return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))


_ONE_BITS = np.float32(1.0).view(np.uint32)  # 0x3F800000


def _pixels_in_unit_range(arr: np.ndarray) -> bool:
    """Finiteness and [0, 1] in one pass: read as unsigned 32-bit integers, the float32 values
    +0.0 .. 1.0 are exactly the bit patterns 0 .. 0x3F800000 (in order), and every negative
    value, inf and NaN lies above. False also for -0.0 (sign bit set), which the exact
    checks then accept."""
    return bool(arr.view(np.uint32).max() <= _ONE_BITS)


def _check_labels(name: str, arr: np.ndarray, count: int) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{name} must be a numpy array, got {type(arr).__name__}", array=name)
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise InputError(f"{name} must have an integer dtype, got {arr.dtype}", array=name)
    if arr.ndim != 1:
        raise InputError(f"{name} must have shape (N,), got {tuple(arr.shape)}", array=name)
    if arr.shape[0] != count:
        raise InputError(
            f"{name} has {arr.shape[0]} labels but train_images has {count} images", array=name
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 9):
        raise InputError(
            f"{name} must be in 0..9, found min {int(arr.min())} and max {int(arr.max())}",
            array=name,
        )
    return np.ascontiguousarray(arr.astype("<i8", copy=False))


def validate_task(
    train_images: np.ndarray, train_labels: np.ndarray, test_images: np.ndarray
) -> TaskArrays:
    """Check every array; each violation names the array and the problem."""
    tr = _check_images("train_images", train_images)
    labels = _check_labels("train_labels", train_labels, tr.shape[0])
    te = _check_images("test_images", test_images)
    return TaskArrays(tr, labels, te)


# --------------------------------------------------------------------------- safe npz


def _member_kind(name: str) -> str:
    stem = name[:-4] if name.endswith(".npy") else name
    return stem


def _reject_members(names: list[str]) -> None:
    stems = [_member_kind(n) for n in names]
    extra = [n for n, s in zip(names, stems) if s not in ALLOWED_MEMBERS or not n.endswith(".npy")]
    dupes = sorted({s for s in stems if stems.count(s) > 1})
    missing = [m for m in ALLOWED_MEMBERS if m not in stems]
    if extra:
        labelish = [n for n in extra if any(w in n.lower() for w in LABEL_WORDS)]
        msg = f"archive holds member(s) not allowed: {', '.join(map(repr, extra))}"
        if labelish:
            msg += (
                " — query/test labels must never be uploaded: the learner sees only "
                "train_images, train_labels and test_images"
            )
        msg += f"; allowed are exactly {', '.join(a + '.npy' for a in ALLOWED_MEMBERS)}"
        raise ArchiveMemberError(msg, extra_members=extra)
    if dupes:
        raise ArchiveMemberError(f"archive holds duplicate member(s): {', '.join(dupes)}")
    if missing:
        raise ArchiveMemberError(
            f"archive is missing member(s): {', '.join(m + '.npy' for m in missing)}; {TASK_FORMAT}",
            missing_members=missing,
        )


# The header np.save writes ("{'descr': '<f4', 'fortran_order': False, 'shape': (50, 1, 9, 9), }",
# spaces, a newline), read without numpy's literal_eval; any other header goes to numpy's reader.
_SAVED_HEADER = re.compile(r"\{'descr': '([<>|=][a-z]\d{1,2})', 'fortran_order': (True|False), "
                           r"'shape': \(((?:\d{1,19}, )*\d{0,19},?)\), \} *\n")


def _saved_header(fh: BinaryIO, limits: Limits) -> tuple[tuple[int, ...], np.dtype, bool] | None:
    """np.save's own header form, parsed directly; None (and ``fh`` back where it was) otherwise."""
    start = fh.tell()
    magic = fh.read(8)
    if len(magic) == 8 and magic[:6] == b"\x93NUMPY" and magic[6] in (1, 2, 3) and magic[7] == 0:
        size = fh.read(2 if magic[6] == 1 else 4)
        length = int.from_bytes(size, "little")
        if len(size) in (2, 4) and length <= limits.max_header_size:
            match = _SAVED_HEADER.fullmatch(fh.read(length).decode("latin-1"))
            if match is not None:
                dims = match.group(3).rstrip(",")
                shape = tuple(int(d) for d in dims.split(", ")) if dims else ()
                if len(shape) != 1 or match.group(3).endswith(","):  # numpy writes (n,) for 1-D
                    return shape, np.dtype(match.group(1)), match.group(2) == "True"
    fh.seek(start)
    return None


def _read_npy_header(fh: BinaryIO, name: str, limits: Limits) -> tuple[tuple[int, ...], np.dtype, bool]:
    if fh.seekable():
        saved = _saved_header(fh, limits)
        if saved is not None:
            return saved
    try:
        version = np.lib.format.read_magic(fh)
    except ValueError as exc:
        raise ArchiveError(f"{name} is not a .npy array: {exc}") from None
    try:
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(
                fh, max_header_size=limits.max_header_size
            )
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(
                fh, max_header_size=limits.max_header_size
            )
        else:  # pragma: no cover - read_magic already restricts versions
            raise ArchiveError(f"{name}: unsupported .npy version {version}")
    except ValueError as exc:
        raise ArchiveError(f"{name} has an invalid or oversized .npy header: {exc}") from None
    if dtype.hasobject:
        raise InputError(f"{name} has an object dtype, which is never loaded (no pickles)", array=name)
    return tuple(shape), dtype, fortran


class _MemoryReader(io.RawIOBase):
    """A read-only file over a memoryview, copying only what is read (zipfile reads the archive's
    directory and compressed members through it)."""

    def __init__(self, memory: memoryview) -> None:
        super().__init__()
        self._memory, self._pos = memory, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._memory)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._memory) if size is None or size < 0 else min(len(self._memory), self._pos + size)
        data = bytes(self._memory[self._pos:end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def read_npz(data: bytes | BinaryIO | str | Path, limits: Limits = DEFAULT_LIMITS) -> dict[str, np.ndarray]:
    """Read exactly the three allowed arrays from an npz, checking before decompressing."""
    memory = None  # the archive's bytes, when it is in memory: stored members are sliced from it
    if isinstance(data, (str, Path)):
        try:
            source: BinaryIO = open(data, "rb")
        except FileNotFoundError:
            raise ArchiveError(f"input file not found: {data}") from None
    elif isinstance(data, (bytes, bytearray, memoryview)):
        memory = memoryview(data)
        if memory.ndim != 1 or memory.itemsize != 1:
            memory = memory.cast("B")
        # for zipfile's directory: BytesIO shares a bytes object's memory but copies any other buffer
        source = io.BytesIO(data) if isinstance(data, bytes) else _MemoryReader(memory)
    else:
        source = data
    try:
        return _read_npz(source, memory, limits, str(data) if isinstance(data, (str, Path)) else "the upload")
    finally:
        if isinstance(data, (str, Path)):
            source.close()


def _read_npz(source: BinaryIO, memory: memoryview | None, limits: Limits, what: str) -> dict[str, np.ndarray]:
    """``what``: the input as a message names it (a file's path, or "the upload")."""
    try:
        zf = zipfile.ZipFile(source)
    except zipfile.BadZipFile as exc:
        raise ArchiveError(f"{what} is not a zip/npz archive (or it is truncated: {exc}); {TASK_FORMAT}") from None
    except (OSError, EOFError, ValueError) as exc:
        raise ArchiveError(f"cannot read archive: {exc}") from None
    with zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
        if len(infos) > limits.max_members:
            _reject_members([i.filename for i in infos])  # names the extras
            raise ArchiveTooLargeError(f"archive has {len(infos)} members, limit {limits.max_members}")
        _reject_members([i.filename for i in infos])
        total = 0
        for info in infos:
            if info.flag_bits & 0x1:
                raise ArchiveError(f"{info.filename} is encrypted")
            if info.file_size > limits.max_member_bytes:
                raise ArchiveTooLargeError(
                    f"{info.filename} declares {info.file_size} uncompressed bytes, "
                    f"limit {limits.max_member_bytes}"
                )
            total += info.file_size
            if info.compress_type != zipfile.ZIP_STORED and info.file_size > 1024 * 1024:
                ratio = info.file_size / max(info.compress_size, 1)
                if ratio > limits.max_ratio:
                    raise ArchiveTooLargeError(
                        f"{info.filename} has compression ratio {ratio:.0f}:1, limit "
                        f"{limits.max_ratio:.0f}:1 (possible zip bomb)"
                    )
        if total > limits.max_total_bytes:
            raise ArchiveTooLargeError(
                f"archive declares {total} uncompressed bytes, limit {limits.max_total_bytes}"
            )
        arrays: dict[str, np.ndarray] = {}
        for info in infos:
            name = _member_kind(info.filename)
            try:
                if info.compress_type == zipfile.ZIP_STORED:
                    arr = _read_stored(source, memory, info, name, limits)
                else:
                    arr = _read_compressed(zf, info, name, limits)
            except zipfile.BadZipFile as exc:
                raise ArchiveError(f"{name} is corrupt: {exc}") from None
            except (EOFError, OSError, ValueError) as exc:
                raise ArchiveError(f"{name} is corrupt or truncated: {exc}") from None
            except Exception as exc:  # zlib.error and friends
                if isinstance(exc, (ArchiveError, ArchiveTooLargeError, InputError)):
                    raise
                raise ArchiveError(f"{name} is corrupt: {exc}") from None
            arrays[name] = np.ascontiguousarray(arr)  # copies only Fortran-ordered arrays
        return arrays


def _array_layout(fh: BinaryIO, name: str, member_size: int, limits: Limits) -> tuple[tuple[int, ...], np.dtype, str, int, int]:
    """Read a member's .npy header from ``fh`` and check it against the limits and the member's
    size: (shape, dtype, order, offset of the data in the member, element count)."""
    shape, dtype, fortran = _read_npy_header(fh, name, limits)
    header_end = fh.tell()
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[0] > limits.max_examples:
        raise ArchiveTooLargeError(f"{name} has {shape[0]} rows, limit {limits.max_examples}")
    nbytes = count * dtype.itemsize
    if nbytes + header_end != member_size:
        raise ArchiveError(
            f"{name}: header says shape {shape} {dtype} ({nbytes} bytes) but "
            f"the member holds {member_size - header_end} data bytes"
        )
    return shape, dtype, "F" if fortran else "C", header_end, count


def _read_compressed(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, limits: Limits) -> np.ndarray:
    """A deflated (or otherwise compressed) member, through zipfile's stream (which checks its CRC)."""
    with zf.open(info) as fh:
        shape, dtype, order, _, count = _array_layout(fh, name, info.file_size, limits)
        buf = bytearray(count * dtype.itemsize)  # writable, exactly the declared size
        if fh.readinto(buf) != len(buf):
            raise ArchiveError(f"{name} is truncated")
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


# A zip local file header (APPNOTE 4.3.7; zipfile.structFileHeader): signature, versions,
# flags, method, time, date, CRC-32, sizes, then the name and extra-field lengths.
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"


def _read_stored(source: BinaryIO, memory: memoryview | None, info: zipfile.ZipInfo, name: str,
                 limits: Limits) -> np.ndarray:
    """A stored (uncompressed) member, read without zipfile's stream: its data is found through
    its local header, its CRC-32 checked, and its bytes copied once, into the array (an
    aligned array of its own: the member's data is rarely aligned in the archive, and a view
    would pin and alias the caller's buffer). ``memory``: the archive's bytes, or None to
    read from ``source``."""

    def read(offset: int, size: int) -> memoryview:
        if memory is not None:
            chunk = memory[offset : offset + size]
        else:
            source.seek(offset)
            chunk = memoryview(bytearray(size))
            chunk = chunk[: source.readinto(chunk) or 0]
        if len(chunk) != size:
            raise ArchiveError(f"{name} is truncated")
        return chunk

    if info.flag_bits & 0x60:  # patched data, strong encryption
        raise ArchiveError(f"{name} uses an unsupported zip feature (flag bits {info.flag_bits:#x})")
    if info.compress_size != info.file_size:
        raise ArchiveError(f"{name} is stored but declares {info.compress_size} stored and "
                           f"{info.file_size} uncompressed bytes")
    fields = _LOCAL_HEADER.unpack(read(info.header_offset, _LOCAL_HEADER.size))
    if fields[0] != _LOCAL_SIGNATURE:
        raise ArchiveError(f"{name} is corrupt: bad local file header")
    name_length, extra_length = fields[10], fields[11]
    at = info.header_offset + _LOCAL_HEADER.size
    local_name = bytes(read(at, name_length)).decode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
    if local_name != info.orig_filename:
        raise ArchiveError(f"{name} is corrupt: its local header names {local_name!r}, "
                           f"the archive's directory {info.orig_filename!r}")
    start = at + name_length + extra_length
    # the .npy header and the limits first, from the member's first bytes, before its data is read
    head = read(start, min(info.file_size, 12 + limits.max_header_size))  # magic, version, length, header
    shape, dtype, order, header_end, count = _array_layout(io.BytesIO(head), name, info.file_size, limits)
    data = read(start, info.file_size)
    if crc32(data) != info.CRC:
        raise ArchiveError(f"{name} is corrupt: bad CRC-32")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header_end)
    if memory is not None or not arr.flags.aligned:
        arr = arr.copy()  # from the caller's buffer (or unaligned): the one copy
    return arr.reshape(shape, order=order)


def load_task(data: bytes | BinaryIO | str | Path, limits: Limits = DEFAULT_LIMITS,
              hash_inputs: bool = True) -> TaskArrays:
    """Safe npz read followed by validation: the one path every task takes. The task's input
    hashes are computed here too (in the caller's thread), once; ``hash_inputs=False`` leaves
    them to the first ``input_hashes()`` call."""
    arrays = read_npz(data, limits)
    task = validate_task(arrays["train_images"], arrays["train_labels"], arrays["test_images"])
    if hash_inputs:
        task.input_hashes()
    return task


def task_to_npz_bytes(task: TaskArrays | dict[str, np.ndarray], compressed: bool = False) -> bytes:
    arrays = task.as_dict() if isinstance(task, TaskArrays) else task
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def save_task(path: str | Path, task: TaskArrays) -> None:
    Path(path).write_bytes(task_to_npz_bytes(task))


# --------------------------------------------------------------------------- MNIST


_IDX_DTYPES = {0x08: np.uint8}


def read_idx(path: str | Path, verify: bool = True) -> np.ndarray:
    """Read an IDX file (optionally .gz): big-endian header, uint8 payload.

    A file with an official MNIST name is checked against its known SHA-256
    (``learner.data.MNIST_SHA256``, of the uncompressed bytes) unless ``verify`` is False."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise InputError(f"MNIST file not found: {path}") from None
    except (OSError, EOFError) as exc:  # e.g. a truncated or non-gzip .gz
        raise InputError(f"cannot read {path}: {exc}") from None
    name = official_name(path)
    if verify and name is not None:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != MNIST_SHA256[name]:
            raise InputError(
                f"{path}: SHA-256 of its IDX bytes is {digest}, not the official {name}'s "
                f"{MNIST_SHA256[name]}; the file is damaged or not the official MNIST file"
            )
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise InputError(f"{path} is not an IDX file (bad magic)")
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code not in _IDX_DTYPES:
        raise InputError(f"{path}: unsupported IDX element type 0x{dtype_code:02x}")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    payload = raw[4 + 4 * ndim :]
    expected = int(np.prod(dims))
    if len(payload) != expected:
        raise InputError(f"{path}: header promises {expected} bytes, payload has {len(payload)}")
    return np.frombuffer(payload, dtype=_IDX_DTYPES[dtype_code]).reshape(dims)


def _find(mnist_dir: Path, stem: str) -> Path:
    if not mnist_dir.is_dir():
        raise InputError(f"MNIST folder not found: {mnist_dir} (pass --mnist-dir DIR with the official idx[.gz] files)")
    for name in (stem, stem + ".gz", stem.replace(".idx", "-idx"), stem.replace(".idx", "-idx") + ".gz"):
        candidate = mnist_dir / name
        if candidate.exists():
            return candidate
    raise InputError(f"MNIST file {stem}[.gz] not found in {mnist_dir}")


def load_mnist_train(mnist_dir: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The official 60,000-row training split; ``mnist_dir`` None: the bundled ``data/mnist``."""
    d = Path(mnist_dir) if mnist_dir is not None else bundled_mnist_dir()
    images = read_idx(_find(d, "train-images.idx3-ubyte"))
    labels = read_idx(_find(d, "train-labels.idx1-ubyte"))
    if images.shape != (60000, 28, 28) or labels.shape != (60000,):
        raise InputError(
            f"expected the official 60,000-row MNIST training split, got images "
            f"{images.shape} and labels {labels.shape}"
        )
    return images, labels


def box_weights(n_in: int = 28, n_out: int = 9) -> np.ndarray:
    """Exact separable box-area weights, overlaps on the integer grid scaled by n_in*n_out."""
    w = np.zeros((n_out, n_in), dtype=np.float64)
    # Output j covers [j*n_in/n_out, (j+1)*n_in/n_out); scaled by n_out: [j*n_in, (j+1)*n_in).
    # Input i covers [i, i+1); scaled by n_out: [i*n_out, (i+1)*n_out).
    for j in range(n_out):
        a0, a1 = j * n_in, (j + 1) * n_in
        for i in range(n_in):
            b0, b1 = i * n_out, (i + 1) * n_out
            overlap = max(0, min(a1, b1) - max(a0, b0))  # integer, in units of 1/n_out
            w[j, i] = overlap / n_in  # (overlap / n_out) / (n_in / n_out)
    return w.astype(np.float32)


def downsample(images_u8: np.ndarray) -> np.ndarray:
    """uint8 (K,28,28) -> float32 (K,1,9,9) by box-area averaging, clipped to [0,1]."""
    x = images_u8.astype(np.float32) / np.float32(255)
    w = box_weights()
    out = np.matmul(np.matmul(w, x), w.T)  # float32 throughout
    out = np.clip(out, np.float32(0), np.float32(1)).astype(np.float32)
    return np.ascontiguousarray(out[:, None, :, :])


def draw_order(dataset_seed: int, n: int = 60000) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(dataset_seed)).permutation(n)


def make_task(
    mnist_dir: str | Path | None, dataset_seed: int, train_count: int = 10000, test_count: int = 10000
) -> tuple[TaskArrays, np.ndarray]:
    """An MNIST-medium draw: (task, held-back query labels)."""
    images, labels = load_mnist_train(mnist_dir)
    order = draw_order(dataset_seed, images.shape[0])
    tr = order[:train_count]
    te = order[train_count : train_count + test_count]
    task = validate_task(downsample(images[tr]), labels[tr].astype(np.int64), downsample(images[te]))
    return task, labels[te].astype(np.int64)
