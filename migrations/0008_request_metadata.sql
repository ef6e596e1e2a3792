-- What a client says about a request besides the request itself (OpenAI's `user`/`safety_identifier` and
-- `metadata`), kept with its usage row so usage can be broken down by end user or by the client's own labels.
ALTER TABLE requests ADD COLUMN end_user text;
ALTER TABLE requests ADD COLUMN metadata jsonb;

-- Conversations keep tool calls and their results: an assistant turn's calls, a tool turn's call id.
ALTER TABLE conversation_messages ADD COLUMN tool_calls jsonb;
ALTER TABLE conversation_messages ADD COLUMN tool_call_id text;

-- `service_tier: "priority"` runs on the top tier only for tenants whose plan allows it (enterprise tenants
-- always may).
ALTER TABLE tenants ADD COLUMN priority_allowed boolean NOT NULL DEFAULT false;
