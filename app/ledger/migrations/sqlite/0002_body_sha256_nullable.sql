-- Version 2 (issue #16): body_sha256 may be NULL. The service hashes a body only when something
-- needs it: an Idempotency-Key (a replay must carry the same body) or an asynchronous task (its
-- stored npz). SQLite cannot drop a NOT NULL, so the table is rebuilt with its rows.
CREATE TABLE tasks_v2 (
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
    body_sha256        TEXT,
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

INSERT INTO tasks_v2 SELECT * FROM tasks;
DROP TABLE tasks;
ALTER TABLE tasks_v2 RENAME TO tasks;
CREATE INDEX tasks_newest ON tasks (created_at DESC, id DESC);
CREATE INDEX tasks_status_newest ON tasks (status, created_at DESC, id DESC);
CREATE INDEX tasks_finished ON tasks (finished_at, id) WHERE finished_at IS NOT NULL;
