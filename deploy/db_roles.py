"""The Postgres role Switchyard's services connect as: not the superuser.

The superuser (the embedded cluster's ``postgres``, or whatever ``switchyard migrate`` is given) applies the
migrations and nothing else. Gateways, workers' jobs and the CLI's services connect as ``switchyard_app``: it may
read and write the rows of Switchyard's tables and use their sequences, and cannot create, alter or drop anything,
read another database, or make roles. The grants are made again after every migration run, so tables a new
migration adds are covered.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg

APP_ROLE = "switchyard_app"


async def ensure_app_role(superuser_url: str, password: str) -> str:
    """Create (or re-password) the app role and grant it the rows of every table; returns its URL (the database
    and server of ``superuser_url``)."""
    conn = await asyncpg.connect(superuser_url)
    try:
        literal = password.replace("'", "''")  # CREATE/ALTER ROLE take no bind parameters
        async with conn.transaction():
            if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", APP_ROLE):
                await conn.execute(f"ALTER ROLE {APP_ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                                   f"PASSWORD '{literal}'")
            else:
                await conn.execute(f"CREATE ROLE {APP_ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                                   f"PASSWORD '{literal}'")
            database = await conn.fetchval("SELECT current_database()")
            await conn.execute(f'GRANT CONNECT ON DATABASE "{database}" TO {APP_ROLE}')
            await conn.execute(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {APP_ROLE}")
            await conn.execute(f"GRANT USAGE ON SCHEMA public TO {APP_ROLE}")
            await conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {APP_ROLE}")
            await conn.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {APP_ROLE}")
    finally:
        await conn.close()
    return role_url(superuser_url, APP_ROLE, password)


def role_url(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password@`` in place of its credentials."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))
