-- Server-side conversations: the history is assembled here and sent with each new turn.
CREATE TABLE conversations (
    id             text PRIMARY KEY,
    tenant_id      text NOT NULL REFERENCES tenants(id),
    model          text,
    system_prompt  text,
    metadata       jsonb NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    deleted_at     timestamptz
);
CREATE INDEX conversations_tenant ON conversations (tenant_id, created_at);

CREATE TABLE conversation_messages (
    id               text PRIMARY KEY,
    conversation_id  text NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    seq              bigserial,                       -- order within the conversation
    role             text NOT NULL,
    content          text NOT NULL,
    status           text NOT NULL DEFAULT 'completed',  -- 'incomplete': a reply cut short (cancelled)
    request_id       text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX conversation_messages_order ON conversation_messages (conversation_id, seq);
