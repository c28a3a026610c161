"""The datasets a task can name instead of carrying its npz (issue #31): stored once, parsed once.

``DatasetCatalog`` is what the routes and the task runner ask: ``put`` reads and checks a
dataset's bytes with the same safe reader, validation and limits as a task's body
(``learner.taskio.load_task``: exactly the three members, so an npz that carries query labels is
refused, 422, as for a task) and stores them under their SHA-256 (app/ledger/datasets.py);
``load`` gives a stored dataset's record, parsed arrays and labels in one call (``task``, its
arrays alone), the arrays from a cache bounded in bytes (REV88_DATASET_CACHE_BYTES, least
recently used first out) or read and parsed again; scoring
labels (``put_labels``) are an ``.npy`` of the query labels, checked and stored apart, used only
to count correct predictions once they exist (``score``), and returned by no route.
"""

from __future__ import annotations

import collections
import hashlib
import io
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from learner.taskio import TaskArrays, load_task

from ..errors import BodyTooLarge, Conflict, InvalidRequest, NotFound
from ..ledger.datasets import DIGEST, DatasetRecord, DatasetsFull, DatasetStore, LabelsConflict, not_a_digest
from ..ledger.owners import open_owners

NO_LABELS_S = 2.0  # a dataset found without labels is asked again after this (app/tasks/datasets.py labels)
MAX_LABELS_BYTES = 16 << 20  # a labels .npy: (M,) int64 for the largest M the task limits allow, and more


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise InvalidRequest(not_a_digest(digest), field="dataset")
    return digest


def digest_of(body: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


class StoredTask(NamedTuple):
    record: DatasetRecord
    task: TaskArrays
    labels: np.ndarray | None  # the scoring labels, if attached (never a task's input nor in an answer)


class DatasetCatalog:
    """The stored datasets, parsed once per process, and who may see each (``owners``: the
    tenants that sent its bytes, app/ledger/owners.py; a ``viewer`` of None sees every one)."""

    def __init__(self, store: DatasetStore, cache_bytes: int) -> None:
        self.store = store
        self.owners = open_owners(store)
        self.cache_bytes = int(cache_bytes)
        self._cache: collections.OrderedDict[str, tuple[TaskArrays, int]] = collections.OrderedDict()
        self._labels: dict[str, np.ndarray] = {}
        self._no_labels: dict[str, float] = {}  # digest -> until when "no labels" stands (monotonic)
        self._cached = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ datasets
    def put(self, body: bytes | memoryview, claimed: str | None = None,
            owner: str | None = None) -> tuple[DatasetRecord, bool]:
        """Store ``body`` (blocking: in a thread). ``claimed``: the digest the client named (PUT):
        a body that does not hash to it is refused. ``owner``: the tenant sending it, one of its
        owners from now on. Already stored: (its record, False) -- but True for an owner that did
        not own it yet, so that the answer says nothing of other tenants' uploads."""
        record, created = self._put(body, claimed)
        if owner is not None and self.owners.own(record.digest, owner):
            created = True
        return record, created

    def _put(self, body: bytes | memoryview, claimed: str | None) -> tuple[DatasetRecord, bool]:
        digest = digest_of(body)
        if claimed is not None and check_digest(claimed) != digest:
            raise InvalidRequest(f"the body's SHA-256 digest is {digest}, which does not match the digest in the URL, "
                                 f"{claimed}: send the bytes that hash to it, or PUT to /datasets/{digest}",
                                 digest=digest)
        existing = self.store.get(digest)
        if existing is not None:
            return existing, False
        task = load_task(bytes(body) if isinstance(body, memoryview) else body)  # same checks as a task's body
        record = DatasetRecord(digest=digest, bytes=len(body), train_count=task.train_count,
                               test_count=task.test_count, input_hashes=dict(task.input_hashes()),
                               created_at=time.time())
        try:
            stored, created = self.store.put(record, bytes(body))
        except DatasetsFull as exc:
            raise BodyTooLarge(str(exc), limit=exc.capacity) from None
        self._keep(digest, task)
        return stored, created

    def get(self, digest: str, viewer: str | None = None) -> DatasetRecord:
        """The dataset's record; absent (NotFound) when missing or, for a ``viewer`` tenant, not its own."""
        record = self.store.get(check_digest(digest))
        if record is None or not self.visible(digest, viewer):
            raise NotFound(f"no dataset {digest} is stored here (PUT /datasets/{digest} stores it)")
        return record

    def visible(self, digest: str, viewer: str | None) -> bool:
        return viewer is None or self.owners.owns(digest, viewer)

    def load(self, digest: str, viewer: str | None = None) -> StoredTask:
        """What a task on a stored dataset needs (blocking: in a thread), for ``POST /tasks?dataset=``,
        a sweep's cells and an evaluation's draws alike: its record (NotFound as ``get``), its parsed
        arrays and its scoring labels (None when it has none)."""
        record = self.get(digest, viewer)
        return StoredTask(record, self.task(digest), self.labels(digest) if record.labels_sha256 else None)

    def task(self, digest: str) -> TaskArrays:
        """A stored dataset's parsed arrays (blocking when not cached: in a thread)."""
        check_digest(digest)
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return hit[0]
        body = self.store.body(digest)
        if body is None:
            raise InvalidRequest(f"dataset {digest} is not stored here (PUT /datasets/{digest} stores it)",
                                 field="dataset")
        task = load_task(body)
        self._keep(digest, task)
        return task

    def _keep(self, digest: str, task: TaskArrays) -> None:
        size = task.train_images.nbytes + task.train_labels.nbytes + task.test_images.nbytes
        with self._lock:
            if digest in self._cache or size > self.cache_bytes:
                return
            self._cache[digest] = (task, size)
            self._cached += size
            while self._cached > self.cache_bytes:
                _, (_, old) = self._cache.popitem(last=False)
                self._cached -= old

    def forget(self, digest: str) -> None:
        with self._lock:
            entry = self._cache.pop(digest, None)
            if entry is not None:
                self._cached -= entry[1]
            self._labels.pop(digest, None)

    # ------------------------------------------------------------------ scoring labels
    def put_labels(self, digest: str, npy: bytes | memoryview, viewer: str | None = None) -> tuple[DatasetRecord, bool]:
        """Attach the query labels (an .npy of shape (M,), integers 0-9, M the dataset's query count)."""
        record = self.get(digest, viewer)
        labels = parse_labels(bytes(npy), record.test_count)
        sha = hashlib.sha256(bytes(npy)).hexdigest()
        try:
            stored, created = self.store.put_labels(digest, bytes(npy), sha)
        except KeyError:
            raise NotFound(f"no dataset {digest} is stored here") from None
        except LabelsConflict as exc:
            raise Conflict(f"{exc}; labels are attached once (DELETE the dataset to start again)") from None
        except DatasetsFull as exc:
            raise BodyTooLarge(str(exc), limit=exc.capacity) from None
        with self._lock:
            self._labels[digest] = labels
            self._no_labels.pop(digest, None)
        return stored, created

    def labels(self, digest: str) -> np.ndarray | None:
        """The dataset's scoring labels (blocking when not cached), or None. Never returned to a client.
        A dataset without labels is asked again after NO_LABELS_S (labels may be attached later,
        through another replica), not for each of a sweep's cells."""
        with self._lock:
            if digest in self._labels:
                return self._labels[digest]
            if self._no_labels.get(digest, 0.0) > time.monotonic():
                return None
        npy = self.store.labels(digest)
        if npy is None:
            with self._lock:
                if len(self._no_labels) > 10_000:
                    self._no_labels.clear()
                self._no_labels[digest] = time.monotonic() + NO_LABELS_S
            return None
        labels = parse_labels(npy, None)
        with self._lock:
            self._labels[digest] = labels
        return labels


def parse_labels(npy: bytes, test_count: int | None) -> np.ndarray:
    """An .npy of query labels, or InvalidRequest (422) saying what is wrong with it."""
    if len(npy) > MAX_LABELS_BYTES:
        raise BodyTooLarge(f"a labels .npy of {len(npy)} bytes is over {MAX_LABELS_BYTES} bytes", limit=MAX_LABELS_BYTES)
    try:
        labels = np.load(io.BytesIO(npy), allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - whatever numpy says of a bad file
        raise InvalidRequest(f"the labels are not a .npy array (np.save's format, no pickle): {exc}",
                             field="labels") from None
    if not isinstance(labels, np.ndarray) or labels.ndim != 1:
        raise InvalidRequest(f"the labels must have shape (M,), one per query; got shape {getattr(labels, 'shape', None)}",
                             field="labels")
    if labels.dtype.kind not in "iu":
        raise InvalidRequest(f"the labels must be integers, got dtype {labels.dtype}", field="labels")
    if test_count is not None and labels.shape[0] != test_count:
        raise InvalidRequest(f"the labels have {labels.shape[0]} entries but the dataset has {test_count} queries",
                             field="labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise InvalidRequest(f"the labels must be classes 0-9, got values from {labels.min()} to {labels.max()}",
                             field="labels")
    return labels.astype(np.int64)


def score(predictions: Any, labels: np.ndarray) -> dict[str, Any]:
    """``correct`` and ``total`` of ``predictions`` against the labels (nothing of the labels)."""
    preds = np.asarray(predictions)
    correct = int((preds == labels).sum())
    return {"correct": correct, "total": int(labels.size),
            "accuracy": round(correct / labels.size, 6) if labels.size else None}
