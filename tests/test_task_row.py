"""The task row, defined once (app/task_row.py; issue #45): each engine's migrated table has exactly
its columns, of its kinds; the record, the SQL column lists, the mapper and the API model derive
from it; a record survives the trip through both engines unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from app.ledger.rows import ALL_COLUMNS, SUMMARY_COLUMNS, record_from_row
from app.ledger.store import Ledger
from app.models import TaskStatus, TaskSummary
from app.task_row import (
    API_COLUMNS,
    KIND_TYPES,
    LISTED_COLUMNS,
    RECORD_COLUMNS,
    TASK_ROW,
    TaskRecord,
    columns_of,
)

from . import pg

pg_server, pg_url = pg.pg_server, pg.pg_url  # the fixtures (tests/pg.py)


def _expected(engine: str) -> dict[str, str]:
    index = 0 if engine == "sqlite" else 1
    return {c.name: KIND_TYPES[c.kind][index] for c in columns_of(engine)}


def test_the_sqlite_table_is_the_row_definition(tmp_path):
    ledger = Ledger(tmp_path / "data")
    try:
        rows = ledger.database.read("read the schema", lambda conn: conn.execute("PRAGMA table_info(tasks)").fetchall())
    finally:
        ledger.close()
    assert {name: declared for _, name, declared, *_ in rows} == _expected("sqlite")


def test_the_postgresql_table_is_the_row_definition(pg_url):
    pg.require_psycopg()
    from app.ledger.postgres import PostgresLedger

    ledger = PostgresLedger(pg_url, owner="schema-test")
    try:
        rows = ledger.database.read("read the schema", lambda conn: conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'rev88_tasks'"
            " AND table_schema = current_schema()").fetchall())
    finally:
        ledger.close()
    assert dict(rows) == _expected("postgresql")


def test_every_other_form_derives_from_it():
    assert [f.name for f in dataclasses.fields(TaskRecord)] == [c.name for c in RECORD_COLUMNS]
    assert SUMMARY_COLUMNS.split(", ") == [c.name for c in LISTED_COLUMNS]
    assert ALL_COLUMNS.split(", ")[len(LISTED_COLUMNS):] == ["answer", "answer_codec"]
    assert list(TaskSummary.model_fields) == [c.name for c in API_COLUMNS]
    assert set(TaskStatus.model_fields) == {c.name for c in API_COLUMNS} | {"error"}
    for c in API_COLUMNS:
        assert TaskSummary.model_fields[c.name].description == c.description
    names = [c.name for c in TASK_ROW]
    assert len(names) == len(set(names)) and all(c.kind in KIND_TYPES for c in TASK_ROW)
    record = TaskRecord(id="t", status="queued", kind="task", mode="async", created_at=1.0, backend="cpu",
                        config={"seed": 1}, options={}, train_count=3, test_count=1, body_bytes=9)
    assert list(record.summary()) == list(TaskSummary.model_fields)
    TaskSummary.model_validate(record.summary())
    assert not record.finished and record.answer_bytes == 0 and record.attempts == 0


def test_the_mapper_decodes_the_json_and_answer_columns():
    from app.ledger.rows import dumps, encode_answer

    values = {c.name: None for c in LISTED_COLUMNS}
    values.update(id="t", status="succeeded", kind="task", mode="sync", created_at=2.0, backend="cpu",
                  config=dumps({"seed": 3}), options=dumps({"owner": "k"}), train_count=5, test_count=2,
                  body_bytes=10, attempts=1, answer_bytes=7, error=None, input_hashes=dumps({"x": "y"}))
    blob, _, _ = encode_answer({"predictions": [1, 2]})
    row = tuple(values[c.name] for c in LISTED_COLUMNS) + (blob, "zlib+json")
    record = record_from_row(row, with_answer=True)
    assert record.config == {"seed": 3} and record.options == {"owner": "k"} and record.input_hashes == {"x": "y"}
    assert record.answer == {"predictions": [1, 2]}
    assert record_from_row(row[:len(LISTED_COLUMNS)], with_answer=False).answer is None
    with pytest.raises(ValueError, match="unknown encoding"):
        record_from_row(row[:-1] + ("gzip",), with_answer=True)


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_a_record_makes_the_trip_through_either_engine(engine, tmp_path, request):
    if engine == "sqlite":
        ledger = Ledger(tmp_path / "data")
    else:
        pg.require_psycopg()
        from app.ledger.postgres import PostgresLedger

        ledger = PostgresLedger(request.getfixturevalue("pg_url"), owner="trip")
    try:
        created, _ = ledger.create(task_id="trip-1", kind="task", mode="async", backend="cpu",
                                   config={"seed": 4, "epochs": 2}, options={"owner": "k-1"}, train_count=8,
                                   test_count=2, body_sha256="a" * 64, body_bytes=3, body=b"npz",
                                   input_hashes={"train_images": "b" * 64})
        answer = {"predictions_sha256": "c" * 64, "timing": {"run_ms": 1.5}, "energy": {"gross_j": 0.25}}
        done = ledger.finish("trip-1", "succeeded", answer=answer)
        got = ledger.get("trip-1")
        listed, _ = ledger.list(owner="k-1")
    finally:
        ledger.close()
    assert got.answer == answer and got.config == {"seed": 4, "epochs": 2} and got.options == {"owner": "k-1"}
    assert (got.predictions_sha256, got.run_ms, got.energy_j) == ("c" * 64, 1.5, 0.25)
    assert got.summary() == done.summary() and listed[0].summary() == got.summary() == {
        **created.summary(), "status": "succeeded", "finished_at": got.finished_at,
        "predictions_sha256": "c" * 64, "run_ms": 1.5, "energy_j": 0.25}


@pytest.mark.parametrize("largest", [[], [9], [10], [100], [12, 100, 255]])
def test_an_answer_with_class_predictions_is_stored_compactly_and_read_back_the_same(largest):
    import numpy as np
    import orjson

    from app.ledger.rows import ANSWER_CODEC, COMPACT_CODEC, decode_answer, encode_answer

    predictions = np.random.default_rng(4).integers(0, 10, 10_000 if largest else 0).astype(np.int64)
    predictions[:len(largest)] = largest
    answer = {"id": "t", "request_id": None, "predictions": predictions, "predictions_sha256": "ab" * 32,
              "metadata": {"seed": 3, "x": [1.5, 2]}, "energy": None}
    blob, json_bytes, codec = encode_answer(answer)
    assert codec == COMPACT_CODEC and len(blob) < 20_000
    as_sent = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    assert json_bytes == len(as_sent)  # the JSON text it stands for, to the byte
    back = decode_answer(blob, codec)
    assert list(back) == list(answer) and back["predictions"] == predictions.tolist()
    assert orjson.dumps(back) == as_sent  # the same document, key order included
    # what is not a class-index array is stored as JSON, as before
    _, _, plain = encode_answer({**answer, "predictions": predictions.tolist()})
    assert plain == ANSWER_CODEC
    _, _, big = encode_answer({**answer, "predictions": np.array([256, 1])})
    assert big == ANSWER_CODEC


def test_the_writes_derive_from_it():
    """Each write's statement (app/ledger/task_writes.py) sets exactly the columns whose ``writes``
    name it, on each engine; a task recorded queued or whole sets every required column; and no
    other module spells the row's columns in an INSERT or in the outcome's UPDATE."""
    import re
    from pathlib import Path

    from app.ledger import task_writes
    from app.task_row import REQUIRED

    required = {c.name for c in RECORD_COLUMNS if c.default is REQUIRED}
    for engine in ("sqlite", "postgresql"):
        for write in task_writes.WRITES:
            names = task_writes.columns(write, engine)
            assert names == tuple(c.name for c in columns_of(engine) if write in c.writes)
            statement = task_writes.insert("t", write, engine, task_writes.sqlite_mark)
            assert statement.sql == f"INSERT INTO t ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
            assert statement.values({n: i for i, n in enumerate(names)}) == tuple(range(len(names)))
        assert required <= set(task_writes.columns("new", engine)) <= {c.name for c in columns_of(engine)}
        assert required | {"finished_at", "answer"} <= set(task_writes.columns("finished", engine))
        assert {"status", "finished_at", "answer", "error"} <= set(task_writes.columns("outcome", engine))
    given = task_writes.assignments("outcome", "sqlite", task_writes.sqlite_mark,
                                    {"has_upload": "0", "input_hashes": "COALESCE({}, input_hashes)"})
    assert "has_upload = 0" in given.sql and "input_hashes = COALESCE(?, input_hashes)" in given.sql
    assert "has_upload" not in given.names and "input_hashes" in given.names
    with pytest.raises(ValueError, match="sets no column lease_owner on sqlite"):
        task_writes.insert("t", "new", "sqlite", task_writes.sqlite_mark, {"lease_owner": "NULL"})
    with pytest.raises(ValueError, match="unknown write"):
        task_writes.columns("running", "sqlite")
    root = Path(__file__).resolve().parents[1] / "app"
    spelled = [path for path in root.rglob("*.py") if path.name != "task_writes.py"
               and (re.search(r"INSERT INTO (rev88_)?tasks \(", path.read_text())
                    or re.search(r"answer_codec = [?%]", path.read_text()))]
    assert spelled == []


def test_a_batchs_rows_carry_the_same_json_as_each_rows_own():
    """``new_rows`` encodes a flat value equal to one it has encoded once (a sweep's cells share their
    options and input hashes): every row's text is still its own value's, whatever the types."""
    from app.ledger.task_writes import new_row, new_rows

    shared = {"dataset": "sha256:" + "a" * 64, "sweep": "s1", "owner": None, "include_scores": False}
    values = [dict(shared), dict(shared), {**shared, "owner": "k1"}, {"a": 1}, {"a": True}, {"a": 1.0},
              {"a": [1, 2]}, {"a": {"b": 1}}, {"a": {"b": True}}, {"b": 1, "a": 2}, {"a": 2, "b": 1}, {}, None]
    tasks = [dict(task_id=f"t{i}", kind="task", mode="async", backend="cpu", config={"seed": i, "lr": v},
                  options=v if v is not None else {}, train_count=10, test_count=5, input_hashes=v,
                  body_sha256="b" * 64, body_bytes=1) for i, v in enumerate(values)]
    batch = new_rows(tasks, created_at=1.0)
    for t, row in zip(tasks, batch, strict=True):
        alone = new_row(t["task_id"], t["kind"], t["mode"], t["backend"], t["config"], t["options"], t["train_count"],
                        t["test_count"], t["input_hashes"], t["body_sha256"], t["body_bytes"], created_at=1.0)
        assert row == alone


def test_a_json_column_reads_back_as_json_reads_it():
    """Every value ``dumps`` writes reads back the same, of the same types, as json.loads reads it (a
    faster parser is no drop-in: orjson reads an integer past 64 bits as a float, 2026-12-06)."""
    import json

    from app.ledger.rows import dumps, loads

    values = [{"seed": 2**63 - 1, "big": 2**64 + 1, "neg": -(2**70)}, {"lr": 1e-05, "x": 0.1, "z": -0.0, "e": 1e308},
              {"name": "é ü 漢 \U0001f600", "lone": "\ud800"}, [1, True, 1.0, None, "1"], {"a": {"b": [{"c": []}]}},
              "text", 3, 2.5, True, None]
    for value in values:
        text = dumps(value)
        got, want = loads(text), json.loads(text)
        assert got == want and repr(got) == repr(want)
    assert loads(None) is None
