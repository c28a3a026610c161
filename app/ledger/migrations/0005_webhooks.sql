-- Webhook outbox (issue #34; app/ledger/outbox.py holds the same text for SQLite)
CREATE TABLE rev88_webhook_messages (
    id text PRIMARY KEY,               -- msg_<hex>: the webhook-id header of every attempt
    owner text NOT NULL,               -- the tenant: a key id, or empty for admin and an open service
    subject_kind text NOT NULL,        -- task | sweep | evaluation
    subject_id text NOT NULL,
    event text NOT NULL,               -- started | completed
    url text NOT NULL,
    state text NOT NULL,               -- waiting | pending | delivered | failed | stopped | skipped
    type text,                         -- task.succeeded, ...: set with the body when the event happens
    body bytea,                       -- the JSON body, the same bytes on every attempt
    created_at double precision NOT NULL,
    ready_at double precision,                   -- when the event happened (pending from then)
    next_at double precision,                    -- the next attempt, while pending
    attempts integer NOT NULL DEFAULT 0,
    round_start integer NOT NULL DEFAULT 0,  -- attempts before the last redelivery: its schedule restarts
    lease_owner text,
    lease_expires_at double precision,
    finished_at double precision,
    last_error text,
    checked_at double precision                  -- when the state of a sweep or an evaluation was last looked at
);
CREATE INDEX rev88_webhook_messages_state ON rev88_webhook_messages (state, next_at);
CREATE INDEX rev88_webhook_messages_subject ON rev88_webhook_messages (subject_id);
CREATE TABLE rev88_webhook_attempts (
    message_id text NOT NULL,
    n integer NOT NULL,                -- 1, 2, ...: every attempt, redeliveries included
    at double precision NOT NULL,
    url text NOT NULL,
    address text,                      -- the checked address the request went to
    status_code integer,
    duration_ms double precision,
    error text,
    outcome text NOT NULL,             -- delivered | retry | failed | stopped
    next_at double precision,
    replica text,
    PRIMARY KEY (message_id, n)
);
CREATE TABLE rev88_webhook_secrets (
    owner text PRIMARY KEY,
    secret text NOT NULL,              -- whsec_...: signs (a shared secret, so kept as it is)
    previous_secret text,              -- the secret before the last rotation ...
    previous_until double precision,             -- ... signing too until then
    created_at double precision NOT NULL,
    rotated_at double precision
);
CREATE TABLE rev88_webhook_stopped (
    owner text NOT NULL,
    url text NOT NULL,
    at double precision NOT NULL,                -- when the 410 came
    message_id text,
    PRIMARY KEY (owner, url)
);
