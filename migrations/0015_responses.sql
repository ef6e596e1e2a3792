-- The Responses API's stored responses (domain/responses.py): per tenant, like conversations. The response object
-- is kept whole as the client got it (``body``), with the few fields a query needs beside it. ``json``, not jsonb:
-- JSON holds U+0000 in a string (a user may send it, a model may write it), jsonb cannot.
CREATE TABLE responses (
    id                    text PRIMARY KEY,                 -- resp_<request id>
    tenant_id             text NOT NULL REFERENCES tenants(id),
    request_id            text NOT NULL,                    -- the wire request's id: llm.cancel.<request_id>
    status                text NOT NULL,                    -- queued | in_progress | completed | incomplete | failed | cancelled
    background            boolean NOT NULL DEFAULT false,
    previous_response_id  text,
    conversation_id       text,
    input_items           json NOT NULL,                    -- this request's input, as items with ids
    body                  json NOT NULL,                    -- the response object
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    deleted_at            timestamptz
);
CREATE INDEX responses_tenant ON responses (tenant_id, created_at);
-- Background responses a gateway was running when it stopped are found by housekeeping.
CREATE INDEX responses_unfinished ON responses (updated_at) WHERE status IN ('queued', 'in_progress');
