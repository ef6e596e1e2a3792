-- Each tenant's safety policy (gateway/safety.py): what the input and output filters do with a flagged request.
-- NULL: the deployment's default (gateway.safety.default_policy, `block` unless configured otherwise), so an
-- operator changes every tenant that has not chosen with one setting.
ALTER TABLE tenants ADD COLUMN safety_policy text CHECK (safety_policy IN ('off', 'log', 'block'));
