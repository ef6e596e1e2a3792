-- One row per finished request: the source of usage accounting and latency reports.
CREATE TABLE requests (
    request_id        text PRIMARY KEY,
    model             text NOT NULL,
    tier              text NOT NULL,
    tenant_id         text,
    api_key_id        text,
    prompt_tokens     integer NOT NULL,
    completion_tokens integer NOT NULL,
    cached_tokens     integer NOT NULL DEFAULT 0,
    finish_reason     text NOT NULL,
    queue_ms          double precision NOT NULL,
    first_token_ms    double precision,          -- null when no token was produced
    total_ms          double precision NOT NULL,
    worker_id         text,                      -- null when no worker took the request
    created_at        timestamptz NOT NULL,      -- when the gateway accepted the request
    recorded_at       timestamptz NOT NULL DEFAULT now()
);

-- Usage per tenant over a time window, and time-ordered scans for reports.
CREATE INDEX requests_tenant_created_idx ON requests (tenant_id, created_at);
CREATE INDEX requests_created_idx ON requests (created_at);
