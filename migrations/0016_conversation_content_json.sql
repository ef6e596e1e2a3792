-- A conversation message's text as a JSON string, not ``text``: a model may write U+0000 (a byte-level tokenizer
-- has a token for byte 0), which ``text`` and ``jsonb`` refuse; ``json`` keeps it as the "\u0000" escape, so the
-- stored turn is the reply the client got (the responses table does the same, 0015).
ALTER TABLE conversation_messages ALTER COLUMN content TYPE json USING to_json(content);
