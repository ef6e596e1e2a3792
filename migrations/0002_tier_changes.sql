-- Every live change of a tier's policy: who, when, old -> new. The live value itself is in the NATS KV bucket
-- `tiers` (read by every gateway and worker); this table is the audit trail.
CREATE TABLE tier_changes (
    id          bigserial PRIMARY KEY,
    tier        text NOT NULL,
    changed_by  text NOT NULL,
    changed_at  timestamptz NOT NULL DEFAULT now(),
    old_policy  jsonb NOT NULL,
    new_policy  jsonb NOT NULL
);
CREATE INDEX tier_changes_tier_at ON tier_changes (tier, changed_at);
