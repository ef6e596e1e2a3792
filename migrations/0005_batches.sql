-- The Batch API: uploaded files (contents in bytea, transactional with their metadata), batches, and one row per
-- input line (its state, its deterministic request id, its result).
CREATE TABLE files (
    id          text PRIMARY KEY,                 -- file-<hex>
    tenant_id   text NOT NULL REFERENCES tenants(id),
    purpose     text NOT NULL,                    -- batch (uploads), batch_output (results)
    filename    text NOT NULL,
    bytes       bigint NOT NULL,
    content     bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    deleted_at  timestamptz
);
CREATE INDEX files_tenant ON files (tenant_id, created_at);

CREATE TABLE batches (
    id                 text PRIMARY KEY,          -- batch_<hex>
    tenant_id          text NOT NULL REFERENCES tenants(id),
    api_key_id         text,
    input_file_id      text NOT NULL,
    endpoint           text NOT NULL,
    completion_window  text NOT NULL,
    metadata           jsonb,
    status             text NOT NULL DEFAULT 'validating',
    errors             jsonb,                     -- {"object": "list", "data": [{code, message, param, line}]}
    output_file_id     text,
    error_file_id      text,
    model              text,                      -- the lines' model when they all name the same one
    request_counts     jsonb,                     -- frozen when the batch ends; live from batch_lines before
    usage              jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    in_progress_at     timestamptz,
    finalizing_at      timestamptz,
    completed_at       timestamptz,
    failed_at          timestamptz,
    expired_at         timestamptz,
    cancelling_at      timestamptz,
    cancelled_at       timestamptz,
    expires_at         timestamptz NOT NULL
);
CREATE INDEX batches_tenant ON batches (tenant_id, created_at);
-- The runner's work list: only batches that are not finished.
CREATE INDEX batches_active ON batches (status) WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling');

CREATE TABLE batch_lines (
    batch_id     text NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
    line_no      integer NOT NULL,                -- 1-based line in the input file
    custom_id    text NOT NULL,
    body         jsonb NOT NULL,
    status       text NOT NULL DEFAULT 'pending', -- pending | queued | completed | failed | cancelled
    request_id   text NOT NULL,                   -- derived from (batch id, custom_id): the same on every retry
    attempts     integer NOT NULL DEFAULT 0,      -- publishes so far (a re-publish after a worker died adds one)
    stream_seq   bigint,                          -- where the current attempt sits in REQUESTS_BATCH
    worker_id    text,                            -- the worker that took the current attempt
    queued_at    timestamptz,                     -- published (or last seen still waiting in the stream)
    response     jsonb,
    error        jsonb,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE UNIQUE INDEX batch_lines_request ON batch_lines (request_id);
CREATE INDEX batch_lines_status ON batch_lines (batch_id, status);
