"""learner/hashing.py: an array's SHA-256 is that of its C-contiguous little-endian bytes, whatever
its layout or byte order (the reference records' rule), on its fast path and off it."""

import hashlib

import numpy as np
import pytest

from learner.hashing import array_sha256, named_sha256, state_vector


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


# ---------------------------------------------------------------------------- many at once
# learner/hashing.py's sha256_many: the digests of many buffers, sixteen side by side through the
# AVX-512 rounds of learner/sha256_lanes.c where the CPU has them, else one by one. Either way the
# same text as hashlib's.

def _lanes():
    return pytest.importorskip("learner._sha256_lanes", reason="the C extension is not built here")


def _message(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


# every length about a block's edges: the padding takes one block below 56 bytes of tail, two from 56
LENGTHS = [*range(0, 260), 447, 448, 1023, 1024, 1025, 6724, 3280, 40, 30216, 80000, 400000]


def _kernels() -> list[bool]:
    """(generic) of each kernel this machine runs: the plain C lanes everywhere, AVX-512 where the
    CPU has it (this project's machines do: a CI without it would not test those rounds)."""
    return [True, False] if _lanes().has_avx512() else [True]


@pytest.mark.parametrize("generic", [True, False], ids=["plain C lanes", "AVX-512 lanes"])
def test_the_lanes_hash_every_length_as_hashlib(generic):
    if generic not in _kernels():
        pytest.skip("this CPU has no AVX-512 (F and BW)")
    items = [_message(n) for n in LENGTHS]
    assert _lanes().digests(items, generic=generic) == [hashlib.sha256(m).hexdigest() for m in items]
    # fewer items than lanes, one item, none
    assert _lanes().digests(items[50:53], generic=generic) == [hashlib.sha256(m).hexdigest() for m in items[50:53]]
    assert _lanes().digests([b"abc"], generic=generic) == [hashlib.sha256(b"abc").hexdigest()]
    assert _lanes().digests([], generic=generic) == []


@pytest.mark.parametrize("generic", [True, False], ids=["plain C lanes", "AVX-512 lanes"])
def test_the_lanes_hash_a_list_of_buffers_as_their_concatenation(generic):
    if generic not in _kernels():
        pytest.skip("this CPU has no AVX-512 (F and BW)")
    # a block's 64 bytes across two, three and more parts, at every offset; empty parts anywhere
    splits = [(1, 2, 3), (63, 1), (64,), (0, 0, 65), (100, 200, 57), (6724,) * 4 + (3280, 40), (), (0,),
              *[(k, 130 - k) for k in range(0, 131, 7)], (5,) * 40, (1,) * 64, (32, 0, 32, 0, 56, 8)]
    items = [[_message(n, seed=i * 100 + j) for j, n in enumerate(split)] for i, split in enumerate(splits)]
    want = [hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest() for parts in items]
    assert _lanes().digests(items, generic=generic) == want
    assert _lanes().digests([tuple(parts) for parts in items], generic=generic) == want


def test_sha256_many_is_array_sha256_of_each_whichever_way_it_hashes(monkeypatch):
    import learner.hashing as hashing

    arrays = list(CASES.values()) + [_message(n).view(np.uint8) for n in (0, 55, 56, 64, 6724, 400000)]
    arrays += [np.arange(1681, dtype=np.float32).reshape(41, 41)] * 20
    lists = [[CASES["float32 C-contiguous (the fast path)"], np.ones(7, np.float32)],
             [np.arange(6, dtype=">f4").reshape(2, 3), np.arange(3, dtype="<f4")],  # one dtype, two byte orders
             [np.arange(3, dtype=np.float32), np.arange(3, dtype=np.float64)]]  # promoted, as state_vector does
    want = [array_sha256(a) for a in arrays] + [array_sha256(state_vector(parts)) for parts in lists]
    calls = []
    lanes = hashing._lanes

    def counted():
        calls.append(1)
        return lanes()

    monkeypatch.setattr(hashing, "_lanes", counted)
    for speedup in (0.0, 100.0):  # one by one; sixteen side by side whatever the sizes
        monkeypatch.setattr(hashing, "lanes_speedup", lambda speedup=speedup: speedup)
        if speedup and not hashing._lanes_ready():
            continue
        calls.clear()
        assert hashing.sha256_many(arrays + lists) == want
        assert bool(calls) == bool(speedup)


def test_sha256_many_takes_the_lanes_only_where_they_are_worth_it(monkeypatch):
    import learner.hashing as hashing

    if not hashing._lanes_ready():
        pytest.skip("the lanes cannot run here (the extension or AVX-512 missing)")
    calls = []
    lanes = hashing._lanes
    monkeypatch.setattr(hashing, "_lanes", lambda: calls.append(1) or lanes())
    monkeypatch.setattr(hashing, "lanes_speedup", lambda: 1.9)
    scores = [np.random.default_rng(i).random(100_000, dtype=np.float32) for i in range(16)]
    small = [np.ones(1681, np.float32)] * 12
    hashing.sha256_many(scores[:1] + small)  # one task's: its 400 KB alone in a lane, the rest idle
    assert calls == []
    assert hashing.sha256_many(scores + small) == [array_sha256(a) for a in scores + small]  # a launch's
    assert calls == [1]


def test_run_digests_are_the_metadatas_hashes_of_each_run():
    from learner.backends.base import RunOutput
    from learner.result import device_predictions, run_digests

    def run(seed: int, queries: int) -> RunOutput:
        rng = np.random.default_rng(seed)
        shapes = [(41, 41)] * 4 + [(10, 82), (10,)]
        return RunOutput(final_parameters=[rng.random(s, dtype=np.float32) for s in shapes],
                         final_velocity=[rng.random(s, dtype=np.float32) for s in shapes],
                         scores=rng.random((queries, 10), dtype=np.float32), training_prediction_seconds=0.0,
                         preparation_seconds=0.0)

    outs = [run(seed, 100 + 13 * seed) for seed in range(20)]
    outs[3].scores[7, 2] = np.nan  # (a run's non-finite entries are its own: found for it alone)
    outs[7].final_parameters[5][2] = np.inf
    outs[11].final_velocity[0][40, 40] = -np.inf
    outs[11].scores[0, 0] = np.nan
    non_finite = {3: ["scores"], 7: ["parameters"], 11: ["scores", "velocity"]}
    names = [str(i) for i in range(6)]
    for i, (out, got) in enumerate(zip(outs, run_digests(outs), strict=True)):
        assert got == {"predictions_sha256": array_sha256(device_predictions(out)),
                       "scores_sha256": array_sha256(out.scores),
                       "final_parameters": list(named_sha256(names, out.final_parameters).values()),
                       "final_velocity": list(named_sha256(names, out.final_velocity).values()),
                       "state_vector_sha256": array_sha256(state_vector(out.final_parameters)),
                       "non_finite": non_finite.get(i, [])}, i
