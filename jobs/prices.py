"""Model prices from the configuration (``models[].input_per_mtok``/``output_per_mtok``) into Postgres
``model_prices``, where the usage writer prices every record as it inserts it (jobs/usage_writer.py).

Applied at start (``switchyard up``, ``switchyard migrate``), so a price in the settings file is the price billed;
a model without one is billed at the ``'*'`` row.
"""

from __future__ import annotations

import asyncpg

from switchyard.shared.config import ModelEntry

UPSERT_SQL = """
INSERT INTO model_prices (model, input_per_mtok, output_per_mtok) VALUES ($1, $2, $3)
ON CONFLICT (model) DO UPDATE SET input_per_mtok = EXCLUDED.input_per_mtok, output_per_mtok = EXCLUDED.output_per_mtok
"""


async def apply_prices(database_url: str, models: list[ModelEntry]) -> list[str]:
    """Write the price of every model that has one; returns what was written, a line each."""
    priced = [m for m in models if m.input_per_mtok is not None or m.output_per_mtok is not None]
    if not priced:
        return []
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT input_per_mtok, output_per_mtok FROM model_prices WHERE model = '*'")
        # Without the '*' row the usage writer bills an unpriced model nothing: so does a missing direction here.
        default_input, default_output = (0.0, 0.0) if row is None else (float(row["input_per_mtok"]),
                                                                        float(row["output_per_mtok"]))
        lines = []
        for m in priced:
            # A price given for one direction only keeps the default for the other.
            input_price = m.input_per_mtok if m.input_per_mtok is not None else default_input
            output_price = m.output_per_mtok if m.output_per_mtok is not None else default_output
            await conn.execute(UPSERT_SQL, m.served_name, input_price, output_price)
            lines.append(f"{m.served_name}: ${input_price:g} in, ${output_price:g} out per million tokens")
        return lines
    finally:
        await conn.close()
