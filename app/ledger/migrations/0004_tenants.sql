-- API keys (issue #33; app/ledger/keys.py): a row per key, its secret only as a SHA-256; every
-- replica reads them, so a revocation holds everywhere.
CREATE TABLE rev88_keys (
    id text PRIMARY KEY,
    name text NOT NULL,
    prefix text NOT NULL,                 -- the secret's first characters, to recognise it by
    secret_sha256 text NOT NULL UNIQUE,
    previous_sha256 text,                 -- the secret before the last rotation ...
    previous_until double precision,      -- ... valid until then (the grace period)
    scopes text NOT NULL,                 -- JSON list: read, write, admin
    max_queued integer,
    max_running integer,
    rate_per_minute double precision,
    weight double precision NOT NULL,
    expires_at double precision,
    created_at double precision NOT NULL,
    revoked_at double precision,
    last_used_at double precision,
    rate_tat double precision             -- the rate limit's bucket (app/ledger/keys.py: GCRA)
);
CREATE INDEX rev88_keys_previous ON rev88_keys (previous_sha256);

-- Who may see a stored dataset (app/ledger/owners.py): each tenant that sent its bytes.
CREATE TABLE rev88_dataset_owners (
    digest text NOT NULL,
    owner text NOT NULL,                  -- the tenant: a key's id, or admin
    created_at double precision NOT NULL,
    PRIMARY KEY (digest, owner)
);
CREATE INDEX rev88_dataset_owners_owner ON rev88_dataset_owners (owner);

-- The tenant whose key made a sweep (NULL: made on an open service)
ALTER TABLE rev88_sweeps ADD COLUMN owner text;
