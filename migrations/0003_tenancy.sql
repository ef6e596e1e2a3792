-- Tenants, API keys (only a hash stored), model prices, per-key rate-limit windows, and billing columns.
CREATE TABLE tenants (
    id                    text PRIMARY KEY,
    name                  text NOT NULL UNIQUE,
    tier                  text NOT NULL,
    rpm_limit             integer,          -- NULL: the tier's default
    tpm_limit             integer,          -- NULL: the tier's default
    monthly_token_budget  bigint,           -- NULL: unlimited
    created_at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id            text PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants(id),
    key_hash      bytea NOT NULL UNIQUE,    -- sha256 of the secret: keys are 190-bit random, no slow hash needed
    prefix        text NOT NULL,            -- shown in listings, e.g. sk-sy-AbCd
    name          text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    last_used_at  timestamptz,
    revoked_at    timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

CREATE TABLE model_prices (
    model                text PRIMARY KEY,
    input_per_mtok       numeric(12, 6) NOT NULL,   -- USD per 1M prompt tokens
    output_per_mtok      numeric(12, 6) NOT NULL,   -- USD per 1M completion tokens
    batch_discount       numeric(4, 3) NOT NULL DEFAULT 0.5  -- fraction off for the batch tier
);
-- '*' prices every model without a row of its own.
INSERT INTO model_prices (model, input_per_mtok, output_per_mtok) VALUES ('*', 0.10, 0.20);

-- Fixed one-minute windows per key: one atomic upsert admits or refuses a request across every gateway.
CREATE TABLE rate_windows (
    key_id        text NOT NULL,
    window_start  timestamptz NOT NULL,
    requests      integer NOT NULL,
    tokens        bigint NOT NULL,
    PRIMARY KEY (key_id, window_start)
);

ALTER TABLE requests ADD COLUMN cost_usd numeric(18, 9) NOT NULL DEFAULT 0;
