-- Graded evaluations (issue #32; app/ledger/evaluations.py): the draws' cells (tasks, whose rows
-- in rev88_tasks carry their state) and the result, written once when the last cell has finished.
CREATE TABLE rev88_evaluations (
    id text PRIMARY KEY,
    created_at double precision NOT NULL,
    name text,
    definition text NOT NULL,             -- JSON: draws, config, backend, measure, protocol
    cells text NOT NULL,                  -- JSON: [{"draw", "dataset", "task_id"[, "measure_task_id"]}]
    idempotency_key text UNIQUE,
    cancelled_at double precision,
    finished_at double precision,
    status text NOT NULL,                 -- running, completed, failed, cancelled
    result text,                          -- JSON: the graded result (GET /evaluations/<id>)
    mean_accuracy double precision,       -- copied out of the result: the leaderboard's orders
    ms_per_task double precision,
    mj_per_task double precision,
    owner text                            -- the tenant whose key made it (NULL: an open service)
);
CREATE INDEX rev88_evaluations_created ON rev88_evaluations (created_at DESC, id DESC);
