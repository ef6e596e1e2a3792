"""Prices from the settings into ``model_prices``: a price given for one direction keeps the default for the other."""

from __future__ import annotations

import asyncpg

from switchyard.jobs.prices import apply_prices
from switchyard.shared.config import ModelEntry

PRICES = "SELECT input_per_mtok, output_per_mtok FROM model_prices WHERE model = $1"


async def test_one_direction_keeps_the_default_for_the_other(database_url):
    lines = await apply_prices(database_url, [ModelEntry(model="m", served_model_name="prices-one-way",
                                                         input_per_mtok=3.0)])
    conn = await asyncpg.connect(database_url)
    try:
        default = await conn.fetchrow(PRICES, "*")
        row = await conn.fetchrow(PRICES, "prices-one-way")
        await conn.execute("DELETE FROM model_prices WHERE model = 'prices-one-way'")
    finally:
        await conn.close()
    assert (float(row["input_per_mtok"]), row["output_per_mtok"]) == (3.0, default["output_per_mtok"])
    assert lines == [f"prices-one-way: $3 in, ${float(default['output_per_mtok']):g} out per million tokens"]


async def test_without_a_default_row_the_unpriced_direction_costs_nothing(database_url):
    """The usage writer bills a model with no price (its own or '*') nothing; a model priced one way only is
    billed the same way for the other, instead of the start failing."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            default = await conn.fetchrow(PRICES, "*")
            await conn.execute("DELETE FROM model_prices WHERE model = '*'")
        try:
            await apply_prices(database_url, [ModelEntry(model="m", served_model_name="prices-no-default",
                                                         output_per_mtok=5.0)])
            row = await conn.fetchrow(PRICES, "prices-no-default")
        finally:
            await conn.execute("INSERT INTO model_prices (model, input_per_mtok, output_per_mtok) VALUES ('*', $1, $2)",
                               default["input_per_mtok"], default["output_per_mtok"])
            await conn.execute("DELETE FROM model_prices WHERE model = 'prices-no-default'")
    finally:
        await conn.close()
    assert (float(row["input_per_mtok"]), float(row["output_per_mtok"])) == (0.0, 5.0)
