"""The conversation store in a real PostgreSQL: a stored turn reads back as the client got it, U+0000 included (a
byte-level tokenizer has a token for byte 0, so a model can write one; ``text`` columns refuse it), in the message
list and in the history the next turn sends to the model."""

from __future__ import annotations

import secrets

from switchyard.domain.conversations import Conversations, write_turn
from switchyard.domain.tenancy import create_tenant
from switchyard.shared.messages import ConversationTurn


async def test_a_reply_with_nul_and_any_text_reads_back_unchanged(pool):
    store = Conversations(pool, js=None)
    async with pool.acquire() as conn:
        tenant = await create_tenant(conn, f"t-{secrets.token_hex(4)}", "pro")
    conv = await store.create(tenant, "m", "Be kind.", {})
    reply = '\ufffd\u0000ct "quoted" \\ back\nslash, café, 東京 \U0001f600'
    await write_turn(pool, ConversationTurn(f"req-{secrets.token_hex(6)}", conv["id"], "First question", reply,
                                            "completed"))
    messages = (await store.messages(conv["id"], tenant, limit=10, after=None, order="asc"))["data"]
    assert [(m["role"], m["content"]) for m in messages] == [("user", "First question"), ("assistant", reply)]
    history, left_out = await store.history(await store.owned(conv["id"], tenant), max_messages=10, max_chars=10_000)
    assert [(m.role, m.content) for m in history] == [("system", "Be kind."), ("user", "First question"),
                                                      ("assistant", reply)]
    assert left_out == 0


async def test_the_history_bound_counts_characters_not_their_escapes(pool):
    """Non-ASCII text is stored as itself, so a bound of N characters keeps a reply of N characters."""
    store = Conversations(pool, js=None)
    async with pool.acquire() as conn:
        tenant = await create_tenant(conn, f"t-{secrets.token_hex(4)}", "pro")
    conv = await store.create(tenant, "m", None, {})
    await write_turn(pool, ConversationTurn(f"req-{secrets.token_hex(6)}", conv["id"], "q", "東" * 50, "completed"))
    history, left_out = await store.history(await store.owned(conv["id"], tenant), max_messages=10, max_chars=60)
    assert [m.content for m in history] == ["q", "東" * 50] and left_out == 0
