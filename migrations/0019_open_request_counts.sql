-- Issue 41 (bursts): a tenant's open requests admitted many at a time, against a count kept in one row.
--
-- 0017 admitted one request per statement, counting every open request of the tenant under its advisory lock: a
-- burst of n requests from one tenant cost n round trips one after another (the gateway runs one tenant's calls
-- one at a time, domain/database.py) and n^2/2 rows counted. Here:
--
--   open_request_counts   a row per tenant: its open requests and their sequences, kept exact by statement
--                         triggers on open_requests, so every insert and delete counts, whoever makes it (an
--                         admission, a settle, a lease expiring in upkeep, a gateway still on 0017)
--   admit_open_requests   one statement for the requests of one tenant that reached a gateway while its last
--                         statement ran (domain/grouped_calls.py): under the same advisory lock as 0017 (so the
--                         two exclude each other while gateways upgrade), the tenant's expired leases deleted
--                         first (only live leases count, as before), each request judged in order against its own
--                         caps as one statement per request would, the admitted ones inserted
--
-- Lock order, so that nothing waits in a circle: open_requests rows first, then counter rows in tenant order.

CREATE TABLE open_request_counts (
    tenant_id  text PRIMARY KEY,
    streams    bigint NOT NULL DEFAULT 0,
    sequences  bigint NOT NULL DEFAULT 0
);
INSERT INTO open_request_counts (tenant_id, streams, sequences)
SELECT tenant_id, count(*), sum(sequences) FROM open_requests GROUP BY tenant_id;

CREATE FUNCTION count_opened_requests() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT tenant_id, count(*) AS streams, sum(sequences) AS sequences FROM opened
             GROUP BY tenant_id ORDER BY tenant_id LOOP
        INSERT INTO open_request_counts AS c (tenant_id, streams, sequences)
        VALUES (t.tenant_id, t.streams, t.sequences)
        ON CONFLICT (tenant_id) DO UPDATE SET streams = c.streams + EXCLUDED.streams,
                                              sequences = c.sequences + EXCLUDED.sequences;
    END LOOP;
    RETURN NULL;
END $$;

CREATE FUNCTION count_closed_requests() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    -- One tenant at a time in tenant order: two gateways' upkeeps expiring leases of the same tenants at once
    -- lock the counter rows in the same order.
    FOR t IN SELECT tenant_id, count(*) AS streams, sum(sequences) AS sequences FROM closed
             GROUP BY tenant_id ORDER BY tenant_id LOOP
        UPDATE open_request_counts SET streams = streams - t.streams, sequences = sequences - t.sequences
        WHERE tenant_id = t.tenant_id;
    END LOOP;
    RETURN NULL;
END $$;

CREATE FUNCTION forget_open_request_counts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM open_request_counts;
    RETURN NULL;
END $$;

-- A lease's row changes only its expiry: a row that changed tenant or sequences would leave the counts wrong.
CREATE FUNCTION refuse_open_request_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'open_requests rows change only expires_at (open_request_counts counts them)';
END $$;

CREATE TRIGGER open_requests_opened AFTER INSERT ON open_requests REFERENCING NEW TABLE AS opened
    FOR EACH STATEMENT EXECUTE FUNCTION count_opened_requests();
CREATE TRIGGER open_requests_closed AFTER DELETE ON open_requests REFERENCING OLD TABLE AS closed
    FOR EACH STATEMENT EXECUTE FUNCTION count_closed_requests();
CREATE TRIGGER open_requests_truncated AFTER TRUNCATE ON open_requests
    FOR EACH STATEMENT EXECUTE FUNCTION forget_open_request_counts();
CREATE TRIGGER open_requests_only_leases_change BEFORE UPDATE OF request_id, tenant_id, sequences ON open_requests
    FOR EACH ROW WHEN (OLD.request_id IS DISTINCT FROM NEW.request_id OR OLD.tenant_id IS DISTINCT FROM NEW.tenant_id
                       OR OLD.sequences IS DISTINCT FROM NEW.sequences)
    EXECUTE FUNCTION refuse_open_request_change();

CREATE FUNCTION admit_open_requests(p_tenant_id text, p_request_ids text[], p_sequences int[],
                                    p_max_streams bigint[], p_max_sequences bigint[], p_lease_s float8,
                                    p_lock_seed bigint)
RETURNS SETOF text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    held_streams bigint;
    held_sequences bigint;
    admitted_ids text[] := '{}';
    admitted_sequences int[] := '{}';
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_tenant_id, p_lock_seed));
    -- Expired leases (a crashed gateway's) leave the count before it is read; a fresh statement snapshot after the
    -- lock sees every admission committed before it (each admission inserts under the lock).
    DELETE FROM open_requests WHERE tenant_id = p_tenant_id AND expires_at <= now();
    SELECT streams, sequences INTO held_streams, held_sequences FROM open_request_counts
    WHERE tenant_id = p_tenant_id;
    held_streams := coalesce(held_streams, 0);
    held_sequences := coalesce(held_sequences, 0);
    FOR i IN 1 .. coalesce(array_length(p_request_ids, 1), 0) LOOP
        IF held_streams + 1 <= p_max_streams[i] AND held_sequences + p_sequences[i] <= p_max_sequences[i] THEN
            held_streams := held_streams + 1;
            held_sequences := held_sequences + p_sequences[i];
            admitted_ids := admitted_ids || p_request_ids[i];
            admitted_sequences := admitted_sequences || p_sequences[i];
        END IF;
    END LOOP;
    RETURN QUERY
        INSERT INTO open_requests (request_id, tenant_id, sequences, expires_at)
        SELECT a.request_id, p_tenant_id, a.sequences, now() + make_interval(secs => p_lease_s)
        FROM unnest(admitted_ids, admitted_sequences) AS a(request_id, sequences)
        ON CONFLICT (request_id) DO NOTHING
        RETURNING open_requests.request_id;
END
$$;
