-- Each batch line's estimated tokens (prompt characters / 4 + n x max_tokens), so a tenant's enqueued batch tokens
-- are one sum over its lines still waiting.
ALTER TABLE batch_lines ADD COLUMN estimated_tokens integer NOT NULL DEFAULT 0;
