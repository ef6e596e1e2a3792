-- Issue 41 (bursts): an API key's requests admitted to its rate window, and settled, many in one statement.
--
-- domain/limits.py admitted each request with one atomic upsert on its key's (key, minute) row, and a gateway runs
-- one key's calls one at a time (domain/database.py): a burst of n requests on one key waited for n round trips
-- one after another, and the settles of the first ones to end queued among them. Here the requests of one key
-- that reached a gateway while its last statement ran go together (domain/grouped_calls.py): the row locked, each
-- judged in order against its own limits as the upsert judged it alone (the previous minute weighed in, the same
-- sliding minute), one row update for all.

CREATE FUNCTION admit_rate_window(p_key_id text, p_window_start timestamptz, p_tokens bigint[], p_rpm bigint[],
                                  p_tpm bigint[], p_previous_weight float8)
RETURNS TABLE (admitted boolean, held_requests bigint, held_tokens bigint) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    previous_requests bigint;
    previous_tokens bigint;
    window_requests bigint;
    window_tokens bigint;
    any_admitted boolean := false;
BEGIN
    -- The previous minute's row no longer changes: read without a lock, weighed by how much of it still lies
    -- within the last 60 s, rounded up (the limit is never exceeded).
    SELECT ceil(coalesce(max(w.requests), 0) * p_previous_weight)::bigint,
           ceil(coalesce(max(w.tokens), 0) * p_previous_weight)::bigint
    INTO previous_requests, previous_tokens
    FROM rate_windows AS w WHERE w.key_id = p_key_id AND w.window_start = p_window_start - interval '1 minute';
    INSERT INTO rate_windows AS w (key_id, window_start, requests, tokens) VALUES (p_key_id, p_window_start, 0, 0)
    ON CONFLICT (key_id, window_start) DO NOTHING;
    SELECT w.requests, w.tokens INTO window_requests, window_tokens
    FROM rate_windows AS w WHERE w.key_id = p_key_id AND w.window_start = p_window_start FOR UPDATE;
    FOR i IN 1 .. coalesce(array_length(p_tokens, 1), 0) LOOP
        admitted := previous_requests + window_requests + 1 <= p_rpm[i]
                    AND previous_tokens + window_tokens + p_tokens[i] <= p_tpm[i];
        IF admitted THEN
            window_requests := window_requests + 1;
            window_tokens := window_tokens + p_tokens[i];
            any_admitted := true;
        END IF;
        held_requests := previous_requests + window_requests;
        held_tokens := previous_tokens + window_tokens;
        RETURN NEXT;
    END LOOP;
    IF any_admitted THEN
        UPDATE rate_windows AS w SET requests = window_requests, tokens = window_tokens
        WHERE w.key_id = p_key_id AND w.window_start = p_window_start;
    END IF;
END
$$;

-- What requests that ended really used, against what they reserved: each difference applied in turn, never below
-- zero, as one UPDATE per request did.
CREATE FUNCTION settle_rate_windows(p_key_id text, p_window_starts timestamptz[], p_differences bigint[])
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_window_starts, 1), 0) LOOP
        UPDATE rate_windows SET tokens = greatest(tokens + p_differences[i], 0)
        WHERE key_id = p_key_id AND window_start = p_window_starts[i];
    END LOOP;
END
$$;
