"""Every rejection of POST /tasks on a real server, each a JSON {"error": ...} with its status:
members, archives, content types, body limits (declared and streamed), zip bombs checked
before decompressing, pickles, the learner's array checks, config and parameters."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import numpy as np
import pytest

from learner.errors import InputError
from learner.taskio import task_to_npz_bytes, validate_task

from .helpers import small_task
from .server import post_task, running_server

LIMIT = 1_000_000  # REV88_MAX_BODY_BYTES for this module's server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("reject-server"), env={"REV88_BACKEND": "cpu", "REV88_MAX_BODY_BYTES": str(LIMIT)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


# --------------------------------------------------------------------------- building bad archives


def npy(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def npy_header(shape: tuple, dtype: str = "<f4") -> bytes:
    """A bare .npy v1.0 header (magic, length, dict), padded as numpy pads it."""
    text = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    text = text + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def zip_of(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def good_members(seed: int = 0) -> dict[str, bytes]:
    task = small_task(19, 7, seed=seed)
    return {f"{name}.npy": npy(arr) for name, arr in task.as_dict().items()}


def with_declared_size(data: bytes, member: str, size: int) -> bytes:
    """Rewrite ``member``'s uncompressed size in the central directory (a lying archive)."""
    raw = bytearray(data)
    pos = raw.find(b"PK\x01\x02")
    while pos != -1:
        name_len = struct.unpack_from("<H", raw, pos + 28)[0]
        name = bytes(raw[pos + 46 : pos + 46 + name_len]).decode()
        if name == member:
            struct.pack_into("<I", raw, pos + 24, size)
            return bytes(raw)
        pos = raw.find(b"PK\x01\x02", pos + 46)
    raise AssertionError(f"{member} not in the central directory")


def assert_error(r, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert isinstance(body.get("error"), str) and body["error"]
    for word in words:
        assert word in body["error"], (word, body["error"])
    return body


def learner_message(**arrays) -> str:
    task = small_task(19, 7).as_dict()
    task.update(arrays)
    with pytest.raises(InputError) as info:
        validate_task(task["train_images"], task["train_labels"], task["test_images"])
    return info.value.message


def post_arrays(client, **arrays):
    task = small_task(19, 7).as_dict()
    task.update(arrays)
    return post_task(client, task_to_npz_bytes(task))


# --------------------------------------------------------------------------- members


def test_query_labels_member_is_422_and_named(client):
    members = good_members()
    members["query_labels.npy"] = npy(np.zeros(7, dtype=np.int64))
    body = assert_error(post_task(client, zip_of(members)), 422, "'query_labels.npy'", "query/test labels")
    assert body["extra_members"] == ["query_labels.npy"]


def test_any_other_extra_member_is_422_and_named(client):
    members = good_members()
    members["notes.txt"] = b"hello"
    assert_error(post_task(client, zip_of(members)), 422, "'notes.txt'", "allowed are exactly")


def test_missing_member_is_422(client):
    members = good_members()
    del members["test_images.npy"]
    assert_error(post_task(client, zip_of(members)), 422, "missing", "test_images.npy")


def test_too_many_members_is_refused_before_reading_any(client):
    members = good_members()
    members.update({f"train_images_{i}.npy": b"" for i in range(200)})
    body = assert_error(post_task(client, zip_of(members)), 422, "not allowed")
    assert len(body["extra_members"]) == 200


# --------------------------------------------------------------------------- archives


def test_not_a_zip_is_400(client):
    """...and says what a task npz holds and how to make one."""
    body = assert_error(post_task(client, b"this is not an npz archive at all" * 10), 400, "not a zip")
    for words in ("train_images", "train_labels", "test_images", "rev88 make-task"):
        assert words in body["error"], body


def test_truncated_archive_is_400(client):
    data = task_to_npz_bytes(small_task(19, 7))
    assert_error(post_task(client, data[: len(data) // 2]), 400)


def test_corrupt_compressed_member_is_400(client):
    data = bytearray(zip_of(good_members(), zipfile.ZIP_DEFLATED))
    start = data.find(b"train_images.npy") + len("train_images.npy") + 40
    for i in range(start, start + 64):
        data[i] ^= 0x5A
    assert_error(post_task(client, bytes(data)), 400, "train_images")


def test_header_promising_more_data_than_the_member_holds_is_400(client):
    members = good_members()
    members["train_images.npy"] = npy_header((500_000, 1, 9, 9)) + b"\0" * 1024
    assert_error(post_task(client, zip_of(members)), 400, "train_images", "header says")


# --------------------------------------------------------------------------- content type


@pytest.mark.parametrize("content_type", ["text/plain", "application/json", "application/zip", None])
def test_unsupported_content_type_is_415(client, content_type):
    data = task_to_npz_bytes(small_task(19, 7))
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = client.post("/tasks", content=data, headers=headers)
    if content_type is None:
        assert "content-type" not in r.request.headers
    body = assert_error(r, 415, "unsupported content type")
    assert "application/octet-stream" in body["accepted"]


# --------------------------------------------------------------------------- body limit


def test_body_over_limit_by_content_length_is_413(client):
    data = b"\0" * (LIMIT + 500_000)
    r = post_task(client, data)
    assert r.request.headers["content-length"] == str(len(data))
    body = assert_error(r, 413, "Content-Length", str(LIMIT))
    assert body["limit"] == LIMIT


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(client, chunked):
    """The limit is inclusive: REV88_MAX_BODY_BYTES bytes are read (and refused as what they are,
    not an npz: 400), one more is a 413, declared or streamed."""
    def send(size: int):
        data = b"\0" * size
        if not chunked:
            return post_task(client, data)
        return client.post("/tasks", content=(data[i : i + 65536] for i in range(0, size, 65536)),
                           headers={"Content-Type": "application/octet-stream"})

    at = send(LIMIT)
    assert at.status_code == 400 and "zip" in at.json()["error"].lower(), at.text
    assert_error(send(LIMIT + 1), 413, str(LIMIT))


def test_chunked_body_over_limit_is_413_counted_while_streaming(client):
    chunk = b"\0" * 50_000

    def stream():
        for _ in range(LIMIT // len(chunk) + 1):  # one chunk past the limit
            yield chunk

    r = client.post("/tasks", content=stream(), headers={"Content-Type": "application/octet-stream"})
    assert "content-length" not in r.request.headers
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert_error(r, 413, "counted while streaming", str(LIMIT))


def test_chunked_body_under_limit_is_accepted(client):
    data = task_to_npz_bytes(small_task(19, 7))

    def stream():
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = client.post("/tasks", content=stream(), headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- zip bombs


def test_declared_member_size_over_limit_is_413(client):
    data = with_declared_size(zip_of(good_members()), "train_images.npy", 300 * 1024 * 1024)
    assert_error(post_task(client, data), 413, "train_images.npy declares", "uncompressed bytes")


@pytest.fixture(scope="module")
def ratio_bomb() -> bytes:
    """A real deflate bomb: ~97 MB of zero pixels (a valid header) in ~100 KB."""
    n = 300_000
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        with zf.open("train_images.npy", "w") as fh:
            fh.write(npy_header((n, 1, 9, 9)))
            block = b"\0" * (81 * 4 * 10_000)
            for _ in range(n // 10_000):
                fh.write(block)
        members = good_members()
        zf.writestr("train_labels.npy", npy(np.zeros(n, dtype=np.int64)))
        zf.writestr("test_images.npy", members["test_images.npy"])
    return buf.getvalue()


def test_compression_ratio_bomb_is_413_before_decompressing(client, ratio_bomb):
    assert len(ratio_bomb) < LIMIT  # it passes the body limit: the archive checks must catch it
    assert_error(post_task(client, ratio_bomb), 413, "compression ratio", "zip bomb")


def test_npy_header_with_huge_shape_is_413(client):
    members = good_members()
    members["train_images.npy"] = npy_header((10**12, 1, 9, 9))
    assert_error(post_task(client, zip_of(members)), 413, "train_images has 1000000000000 rows")


def test_pickled_object_array_is_refused(client):
    members = good_members()
    members["train_labels.npy"] = npy(np.array([1, "x", None] * 6 + [2], dtype=object), allow_pickle=True)
    body = assert_error(post_task(client, zip_of(members)), 422, "object dtype", "no pickles")
    assert body["type"] == "InputError"


# --------------------------------------------------------------------------- the learner's checks


BAD_ARRAYS = {
    "dtype": {"train_images": small_task(19, 7).train_images.astype(np.float64)},
    "shape": {"test_images": np.zeros((7, 1, 28, 28), dtype=np.float32)},
    "range": {"train_images": np.full((19, 1, 9, 9), 1.5, dtype=np.float32)},
    "nan": {"test_images": np.full((7, 1, 9, 9), np.nan, dtype=np.float32)},
    "label_value": {"train_labels": np.full(19, 10, dtype=np.int64)},
    "label_count": {"train_labels": np.zeros(18, dtype=np.int64)},
    "label_dtype": {"train_labels": np.zeros(19, dtype=np.float32)},
}


@pytest.mark.parametrize("problem", sorted(BAD_ARRAYS))
def test_array_errors_are_422_with_the_learners_message(client, problem):
    arrays = BAD_ARRAYS[problem]
    body = assert_error(post_arrays(client, **arrays), 422)
    assert body["error"] == learner_message(**arrays)
    assert body["type"] == "InputError"


# --------------------------------------------------------------------------- config and parameters


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"not_a_key": "1"}, ("unknown config key", "not_a_key")),
        ({"batch_size": "0"}, ("config.batch_size must be > 0",)),
        ({"epochs": "two"}, ("config.epochs must be an integer",)),
        ({"momentum": "1.5"}, ("config.momentum",)),
        ({"backend": "tpu"}, ("unknown backend",)),
        ({"include": "gradients"}, ("include=gradients",)),
        ({"measure": "power"}, ("measure='power'",)),
        ({"trials": "3"}, ("only apply with measure=energy",)),
        ({"measure": "energy", "trials": "0"}, ("trials must be in",)),
        ({"measure": "energy", "idle_seconds": "nan"}, ("idle_seconds must be in",)),
    ],
)
def test_bad_query_parameters_are_422(client, params, words):
    assert_error(post_task(client, task_to_npz_bytes(small_task(19, 7)), params=params), 422, *words)


def test_repeated_query_parameter_is_422(client):
    data = task_to_npz_bytes(small_task(19, 7))
    assert_error(post_task(client, data, params=[("epochs", "1"), ("epochs", "2")]), 422, "more than once", "epochs")


@pytest.mark.parametrize("backend", ["cuda", "fused"])
def test_gpu_backend_without_a_gpu_is_422(client, backend):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = post_task(client, task_to_npz_bytes(small_task(19, 7)), params={"backend": backend})
    assert_error(r, 422, f"backend '{backend}' needs a CUDA GPU", "use backend=cpu")


def test_multipart_unknown_config_key_is_422(client):
    files = {"file": ("t.npz", task_to_npz_bytes(small_task(19, 7)), "application/octet-stream")}
    r = client.post("/tasks", files=files, data={"config": json.dumps({"learning_rat": 0.1})})
    assert_error(r, 422, "unknown config key", "learning_rat (did you mean learning_rate?)")


def test_multipart_config_that_is_not_an_object_is_422(client):
    files = {"file": ("t.npz", task_to_npz_bytes(small_task(19, 7)), "application/octet-stream")}
    assert_error(client.post("/tasks", files=files, data={"config": "[1, 2]"}), 422, "JSON object")
    assert_error(client.post("/tasks", files=files, data={"config": "{oops"}), 422, "not valid JSON")


def test_multipart_config_key_also_in_query_is_422(client):
    files = {"file": ("t.npz", task_to_npz_bytes(small_task(19, 7)), "application/octet-stream")}
    r = client.post("/tasks?epochs=1", files=files, data={"config": json.dumps({"epochs": 2})})
    assert_error(r, 422, "both as query parameter and in the 'config' field", "epochs")


def test_multipart_without_file_or_with_extra_fields_is_422(client):
    data = task_to_npz_bytes(small_task(19, 7))
    assert_error(client.post("/tasks", files={"task": ("t.npz", data)}), 422, "unexpected multipart field", "task")
    assert_error(client.post("/tasks", data={"config": "{}"}, files={"other": ("x", b"1")}), 422, "other")
    r = client.post("/tasks", data={"config": "{}"}, headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    assert r.status_code in (400, 422) and "error" in r.json()


def test_unknown_route_and_method_are_json(client):
    assert_error(client.get("/nope"), 404)
    assert_error(client.delete("/tasks"), 405)  # GET /tasks is the ledger's list now


def test_still_serving_after_every_rejection(client):
    r = post_task(client, task_to_npz_bytes(small_task(19, 7, seed=11)))
    assert r.status_code == 200, r.text
    health = client.get("/health").json()
    assert health["status"] == "ok"
    assert health["queue"]["depth"] == 0 and health["queue"]["in_flight"] == 0


def test_a_small_synchronous_body_refused_by_its_job_is_recorded_nowhere(client):
    """A small synchronous task is parsed by its own job on the device worker: a body refused
    there is answered exactly as on arrival, counted as refused (not failed), and not in the ledger."""
    ids = {t["id"] for t in client.get("/tasks", params={"limit": 500}).json()["tasks"]}
    before = client.get("/health").json()["queue"]
    members = good_members()
    members["query_labels.npy"] = npy(np.zeros(7, dtype=np.int64))
    body = assert_error(post_task(client, zip_of(members)), 422, "'query_labels.npy'", "query/test labels")
    assert body["extra_members"] == ["query_labels.npy"] and "id" not in body
    after = client.get("/health").json()["queue"]
    assert after["refused_input"] == before["refused_input"] + 1
    assert (after["failed"], after["completed"]) == (before["failed"], before["completed"])
    assert {t["id"] for t in client.get("/tasks", params={"limit": 500}).json()["tasks"]} == ids
    keyed = assert_error(post_task(client, zip_of(members), headers={"Idempotency-Key": "refused-1"}), 422,
                         "query/test labels")  # with a key it is parsed on arrival: the same answer
    assert keyed["extra_members"] == body["extra_members"]
    assert client.get("/health").json()["queue"]["refused_input"] == after["refused_input"]
