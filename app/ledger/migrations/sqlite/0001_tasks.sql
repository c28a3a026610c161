-- rev88 task ledger on SQLite, schema version 1 (app/ledger/store.py; issue #15): PRAGMA user_version
-- holds the version; each file is applied once, in one transaction with its version bump.
-- The columns are app/task_row.py's (tests/test_task_row.py checks the migrated table against it).
CREATE TABLE tasks (
    id                 TEXT PRIMARY KEY,
    status             TEXT NOT NULL CHECK (status IN
                           ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    kind               TEXT NOT NULL,
    mode               TEXT NOT NULL,
    created_at         REAL NOT NULL,
    started_at         REAL,
    finished_at        REAL,
    attempts           INTEGER NOT NULL DEFAULT 0,
    backend            TEXT NOT NULL,
    config             TEXT NOT NULL,
    options            TEXT NOT NULL,
    train_count        INTEGER NOT NULL,
    test_count         INTEGER NOT NULL,
    input_hashes       TEXT,
    body_sha256        TEXT NOT NULL,
    body_bytes         INTEGER NOT NULL,
    has_upload         INTEGER NOT NULL DEFAULT 0,
    idempotency_key    TEXT UNIQUE,
    device             TEXT,
    answer             BLOB,
    answer_codec       TEXT,
    answer_bytes       INTEGER NOT NULL DEFAULT 0,
    answer_json_bytes  INTEGER NOT NULL DEFAULT 0,
    error              TEXT,
    predictions_sha256 TEXT,
    run_ms             REAL,
    energy_j           REAL
);
CREATE INDEX tasks_newest ON tasks (created_at DESC, id DESC);
CREATE INDEX tasks_status_newest ON tasks (status, created_at DESC, id DESC);
CREATE INDEX tasks_finished ON tasks (finished_at, id) WHERE finished_at IS NOT NULL;
