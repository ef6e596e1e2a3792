-- Issue 27: what one tenant may hold at once, and a monthly budget that reserves before it admits.

-- Per-tenant caps on requests generating at once (streamed or not) and on their sequences (every choice of each);
-- NULL: the tier's default (TierPolicy.max_streams / max_sequences).
ALTER TABLE tenants ADD COLUMN max_streams integer CHECK (max_streams > 0);
ALTER TABLE tenants ADD COLUMN max_sequences integer CHECK (max_sequences > 0);

-- One row per admitted request until it ends (domain/admission/concurrency.py): counted under a per-tenant
-- advisory lock, so the caps hold across every gateway. A gateway renews the leases of what it still serves; a
-- crashed gateway's rows expire.
CREATE TABLE open_requests (
    request_id  text PRIMARY KEY,
    tenant_id   text NOT NULL,
    sequences   integer NOT NULL,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX open_requests_tenant ON open_requests (tenant_id, expires_at);

-- Each tenant's month: tokens billed (added by a trigger with every row inserted into requests) and tokens
-- reserved by requests admitted and not yet settled (domain/admission/budget.py). One atomic upsert admits a
-- request within its budget, as the rate windows do.
CREATE TABLE budget_months (
    tenant_id  text NOT NULL,
    month      date NOT NULL,
    billed     bigint NOT NULL DEFAULT 0,
    reserved   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, month)
);
INSERT INTO budget_months (tenant_id, month, billed)
SELECT tenant_id, date_trunc('month', created_at AT TIME ZONE 'UTC')::date, sum(prompt_tokens + completion_tokens)
FROM requests WHERE tenant_id IS NOT NULL GROUP BY 1, 2;

CREATE FUNCTION bill_budget_month() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS NOT NULL THEN
        INSERT INTO budget_months AS b (tenant_id, month, billed)
        VALUES (NEW.tenant_id, date_trunc('month', NEW.created_at AT TIME ZONE 'UTC')::date,
                NEW.prompt_tokens + NEW.completion_tokens)
        ON CONFLICT (tenant_id, month) DO UPDATE SET billed = b.billed + EXCLUDED.billed;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER requests_bill_budget_month AFTER INSERT ON requests FOR EACH ROW EXECUTE FUNCTION bill_budget_month();
