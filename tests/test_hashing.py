"""learner/hashing.py: an array's SHA-256 is that of its C-contiguous little-endian bytes, whatever
its layout or byte order (the reference records' rule), on its fast path and off it."""

import hashlib

import numpy as np
import pytest

from learner.hashing import array_sha256, named_sha256


def reference(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"))).tobytes()).hexdigest()


CASES = {
    "float32 C-contiguous (the fast path)": np.arange(12, dtype=np.float32).reshape(3, 4),
    "int64": np.arange(10, dtype=np.int64),
    "big-endian int32": np.arange(10, dtype=">i4"),
    "big-endian float32 2-D": np.arange(12, dtype=">f4").reshape(3, 4),
    "transposed (Fortran order)": np.arange(12, dtype=np.float32).reshape(3, 4).T,
    "strided": np.arange(12, dtype=np.float64)[::2],
    "bool": np.array([True, False, True]),
    "uint8": np.arange(256, dtype=np.uint8),
    "empty": np.zeros(0, dtype=np.float32),
    "zero-dimensional": np.float32(3.5) * np.ones((), dtype=np.float32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_array_sha256_is_the_little_endian_c_order_bytes(name):
    arr = CASES[name]
    assert array_sha256(arr) == reference(arr)


def test_equal_values_in_other_layouts_hash_alike():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert array_sha256(a) == array_sha256(np.asfortranarray(a)) == array_sha256(a.astype(">f4"))
    assert array_sha256(a) != array_sha256(a.T)  # (other values in C order)


def test_named_sha256_names_each_array():
    arrays = [np.ones(3, np.float32), np.zeros((2, 2), np.float32)]
    assert named_sha256(["a", "b"], arrays) == {"a": reference(arrays[0]), "b": reference(arrays[1])}
