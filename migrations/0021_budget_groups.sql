-- Issue 41 (bursts): a tenant's requests reserve from its monthly budget, and give back, many in one statement.
--
-- domain/admission/budget.py reserved each request with one atomic upsert on the tenant's month row, one statement
-- after another (a gateway runs one tenant's calls one at a time): a burst of n requests from a tenant with a
-- budget waited for n round trips. Here the requests of one tenant that reached a gateway while its last statement
-- ran go together (domain/grouped_calls.py): the month's row locked, each judged in order against its budget as
-- the upsert judged it alone, one row update for all.

CREATE FUNCTION reserve_budget(p_tenant_id text, p_month date, p_tokens bigint[], p_budgets bigint[])
RETURNS TABLE (reserved boolean, spent bigint) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    month_billed bigint;
    month_reserved bigint;
    any_reserved boolean := false;
BEGIN
    INSERT INTO budget_months AS b (tenant_id, month) VALUES (p_tenant_id, p_month)
    ON CONFLICT (tenant_id, month) DO NOTHING;
    SELECT b.billed, b.reserved INTO month_billed, month_reserved
    FROM budget_months AS b WHERE b.tenant_id = p_tenant_id AND b.month = p_month FOR UPDATE;
    FOR i IN 1 .. coalesce(array_length(p_tokens, 1), 0) LOOP
        reserved := month_billed + month_reserved + p_tokens[i] <= p_budgets[i];
        IF reserved THEN
            month_reserved := month_reserved + p_tokens[i];
            any_reserved := true;
        END IF;
        spent := month_billed + month_reserved;
        RETURN NEXT;
    END LOOP;
    IF any_reserved THEN
        UPDATE budget_months AS b SET reserved = month_reserved
        WHERE b.tenant_id = p_tenant_id AND b.month = p_month;
    END IF;
END
$$;

-- What ended requests reserved, given back: each in turn, never below zero, as one UPDATE per request did.
CREATE FUNCTION release_budget(p_tenant_id text, p_months date[], p_tokens bigint[])
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_months, 1), 0) LOOP
        UPDATE budget_months SET reserved = greatest(reserved - p_tokens[i], 0)
        WHERE tenant_id = p_tenant_id AND month = p_months[i];
    END LOOP;
END
$$;
