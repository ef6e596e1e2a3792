-- A tenant's open request admitted in one statement (domain/admission/concurrency.py): the per-tenant advisory
-- lock, the count under it and the insert, in one round trip instead of four (BEGIN, lock, insert, COMMIT). Each
-- statement of a VOLATILE function reads a fresh snapshot, so the count sees every admission committed before the
-- lock was granted, as the transaction did; the lock ends with the statement's transaction.
CREATE FUNCTION admit_open_request(p_request_id text, p_tenant_id text, p_sequences int, p_max_streams bigint,
                                   p_max_sequences bigint, p_lease_s float8, p_lock_seed bigint)
RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    admitted text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_tenant_id, p_lock_seed));
    INSERT INTO open_requests (request_id, tenant_id, sequences, expires_at)
    SELECT p_request_id, p_tenant_id, p_sequences, now() + make_interval(secs => p_lease_s)
    FROM (SELECT count(*) AS streams, coalesce(sum(sequences), 0) AS sequences FROM open_requests
          WHERE tenant_id = p_tenant_id AND expires_at > now()) AS held
    WHERE held.streams + 1 <= p_max_streams AND held.sequences + p_sequences <= p_max_sequences
    ON CONFLICT (request_id) DO NOTHING
    RETURNING request_id INTO admitted;
    RETURN admitted;
END
$$;
