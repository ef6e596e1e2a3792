-- Batch line bodies and results as json, not jsonb: a model may write U+0000 (and a user may send it), which
-- JSON allows and jsonb cannot hold; json keeps the text as given. Nothing queries inside them but body->>'model'.
ALTER TABLE batch_lines
    ALTER COLUMN body TYPE json USING body::json,
    ALTER COLUMN response TYPE json USING response::json,
    ALTER COLUMN error TYPE json USING error::json;
