-- Version 3 (issue #34): the webhook outbox beside the tasks, written in their transactions
-- (app/ledger/outbox.py; tests/test_webhooks.py checks this is its SQLITE_SCHEMA).
CREATE TABLE webhook_messages (
    id text PRIMARY KEY,               -- msg_<hex>: the webhook-id header of every attempt
    owner text NOT NULL,               -- the tenant: a key id, or empty for admin and an open service
    subject_kind text NOT NULL,        -- task | sweep | evaluation
    subject_id text NOT NULL,
    event text NOT NULL,               -- started | completed
    url text NOT NULL,
    state text NOT NULL,               -- waiting | pending | delivered | failed | stopped | skipped
    type text,                         -- task.succeeded, ...: set with the body when the event happens
    body BLOB,                       -- the JSON body, the same bytes on every attempt
    created_at REAL NOT NULL,
    ready_at REAL,                   -- when the event happened (pending from then)
    next_at REAL,                    -- the next attempt, while pending
    attempts integer NOT NULL DEFAULT 0,
    round_start integer NOT NULL DEFAULT 0,  -- attempts before the last redelivery: its schedule restarts
    lease_owner text,
    lease_expires_at REAL,
    finished_at REAL,
    last_error text,
    checked_at REAL                  -- when the state of a sweep or an evaluation was last looked at
);
CREATE INDEX webhook_messages_state ON webhook_messages (state, next_at);
CREATE INDEX webhook_messages_subject ON webhook_messages (subject_id);
CREATE TABLE webhook_attempts (
    message_id text NOT NULL,
    n integer NOT NULL,                -- 1, 2, ...: every attempt, redeliveries included
    at REAL NOT NULL,
    url text NOT NULL,
    address text,                      -- the checked address the request went to
    status_code integer,
    duration_ms REAL,
    error text,
    outcome text NOT NULL,             -- delivered | retry | failed | stopped
    next_at REAL,
    replica text,
    PRIMARY KEY (message_id, n)
);
CREATE TABLE webhook_secrets (
    owner text PRIMARY KEY,
    secret text NOT NULL,              -- whsec_...: signs (a shared secret, so kept as it is)
    previous_secret text,              -- the secret before the last rotation ...
    previous_until REAL,             -- ... signing too until then
    created_at REAL NOT NULL,
    rotated_at REAL
);
CREATE TABLE webhook_stopped (
    owner text NOT NULL,
    url text NOT NULL,
    at REAL NOT NULL,                -- when the 410 came
    message_id text,
    PRIMARY KEY (owner, url)
);
