-- Disaggregated serving (issue 39): a request prefilled on one worker and decoded on another is one row, naming
-- both, with the KV bytes its decode worker loaded (from the shared tier or another host) instead of computing.
ALTER TABLE requests ADD COLUMN prefill_worker_id text;               -- null: one worker ran it whole
ALTER TABLE requests ADD COLUMN kv_loaded_bytes bigint NOT NULL DEFAULT 0;
