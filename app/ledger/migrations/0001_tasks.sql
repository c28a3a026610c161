-- rev88 task ledger on PostgreSQL, schema version 1 (app/ledger/postgres.py; issue #22).
-- Applied once, in one transaction, under pg_advisory_lock; rev88_schema records it.
--
-- Times are seconds since the epoch (double precision), as the SQLite ledger keeps them; the
-- server's clock (clock_timestamp()) stamps creation, finishing and every lease, so replicas
-- with different clocks agree on order and on when a lease has expired.

CREATE TABLE rev88_tasks (
    id                  text PRIMARY KEY,
    status              text NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    kind                text NOT NULL CHECK (kind IN ('task', 'measure')),
    mode                text NOT NULL CHECK (mode IN ('sync', 'async')),
    created_at          double precision NOT NULL,
    started_at          double precision,
    finished_at         double precision,
    attempts            integer NOT NULL DEFAULT 0,      -- times marked running
    backend             text NOT NULL,
    config              text NOT NULL,                   -- canonical JSON (sorted keys), compared as text
    options             text NOT NULL,
    train_count         integer NOT NULL,
    test_count          integer NOT NULL,
    input_hashes        text,
    body_sha256         text,
    body_bytes          bigint NOT NULL,
    has_input           boolean NOT NULL DEFAULT false,  -- a row in rev88_task_inputs
    idempotency_key     text UNIQUE,                     -- INSERT ... ON CONFLICT: one task per key, any replica
    device              text,
    answer              bytea,                           -- zlib-compressed JSON (answer_codec)
    answer_codec        text,
    answer_bytes        integer NOT NULL DEFAULT 0,
    answer_json_bytes   integer NOT NULL DEFAULT 0,
    error               text,
    predictions_sha256  text,
    run_ms              double precision,
    energy_j            double precision,
    -- claims and leases: the replica holding the task, until when (server clock), the lease's
    -- epoch (the fence a result is written under), how often a lease expired, a cancel request
    lease_owner         text,
    lease_expires_at    double precision,
    claims              integer NOT NULL DEFAULT 0,
    expiries            integer NOT NULL DEFAULT 0,
    cancel_requested_at double precision,
    CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL))
) WITH (fillfactor = 85);  -- room on the page for HOT updates (a lease renewal touches no index)

-- already compressed: stored out of line as is, never recompressed
ALTER TABLE rev88_tasks ALTER COLUMN answer SET STORAGE EXTERNAL;

CREATE INDEX rev88_tasks_newest ON rev88_tasks (created_at DESC, id DESC);
CREATE INDEX rev88_tasks_status_newest ON rev88_tasks (status, created_at DESC, id DESC);
CREATE INDEX rev88_tasks_finished ON rev88_tasks (finished_at, id) WHERE finished_at IS NOT NULL;
-- what an idle worker claims: oldest first, FOR UPDATE SKIP LOCKED
CREATE INDEX rev88_tasks_claimable ON rev88_tasks (created_at, id)
    WHERE status = 'queued' AND mode = 'async' AND lease_owner IS NULL;
-- what the reaper, recovery and the queue depth read
CREATE INDEX rev88_tasks_unfinished ON rev88_tasks (created_at, id) WHERE status IN ('queued', 'running');

-- The body (npz) of an asynchronous task until it finishes: its own table, so that lists and
-- status reads never touch it; deleted in the transaction that records the task's outcome.
CREATE TABLE rev88_task_inputs (
    task_id text PRIMARY KEY REFERENCES rev88_tasks (id) ON DELETE CASCADE,
    bytes   bigint NOT NULL,
    body    bytea NOT NULL
);
ALTER TABLE rev88_task_inputs ALTER COLUMN body SET STORAGE EXTERNAL;
