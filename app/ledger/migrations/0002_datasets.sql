-- Datasets (issue #31): task npz files stored once, addressed by the SHA-256 of their bytes, and
-- their scoring labels kept apart (app/ledger/datasets_pg.py). Every replica reads every dataset.
CREATE TABLE rev88_datasets (
    digest text PRIMARY KEY,              -- 'sha256:' || hex of the npz bytes
    bytes bigint NOT NULL,
    train_count integer NOT NULL,
    test_count integer NOT NULL,
    input_hashes text NOT NULL,           -- JSON: the hashes a task's metadata carries
    created_at double precision NOT NULL, -- epoch seconds, the server's clock
    labels_sha256 text,
    labels_bytes bigint NOT NULL DEFAULT 0,
    body bytea NOT NULL,
    labels bytea
);
CREATE INDEX rev88_datasets_created ON rev88_datasets (created_at DESC, digest DESC);

-- Sweeps (app/tasks/sweeps.py): a definition and its cells, one task each (the tasks' own rows
-- in rev88_tasks carry their state).
CREATE TABLE rev88_sweeps (
    id text PRIMARY KEY,
    created_at double precision NOT NULL,
    dataset text NOT NULL,
    definition text NOT NULL,             -- JSON: base config, grid, seeds, backend, name
    cells text NOT NULL,                  -- JSON: [{"task_id", "config"}] in order
    idempotency_key text UNIQUE,
    cancelled_at double precision
);
CREATE INDEX rev88_sweeps_created ON rev88_sweeps (created_at DESC, id DESC);
CREATE INDEX rev88_sweeps_dataset ON rev88_sweeps (dataset);
