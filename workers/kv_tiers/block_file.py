"""One KV block as bytes on a tier: a header that names its content, then its token ids, then its K and V.

    offset 0   magic "SYKV" · version · num_tokens · crc32 · payload bytes · block hash (16 bytes)   (40 bytes)
           40  token ids (int32, num_tokens of them)
           ..  payload: K and V of every layer, ``BlockLayout.shape`` in ``BlockLayout.dtype``

The CRC covers everything after it (hash, tokens, payload), so a flipped byte or a torn write is caught before a
block is served; ``decode_block`` also checks that the block is the one asked for (its hash and its tokens), as the
pool does on a hit, so a file under the wrong name can never serve wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from array import array
from dataclasses import dataclass

MAGIC = b"SYKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHIIQ16s")  # magic, version, reserved, num_tokens, crc32, payload bytes, block hash
HEADER_BYTES = _HEADER.size


class CorruptBlock(ValueError):
    """A block's bytes fail their checks (truncated, flipped, or another block's): recompute it, never serve it."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What one block's payload is: its dtype and shape ``(num_layers, 2, block_size, num_kv_heads, head_dim)``.

    Workers share a tier only when their layouts match (``key`` names the tier's directory), so a block is
    never loaded into a cache of another shape, dtype or model.
    """

    model: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def block_size(self) -> int:
        return self.shape[2]

    @property
    def payload_bytes(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                    "int8": 1}[self.dtype]
        n = itemsize
        for dim in self.shape:
            n *= dim
        return n

    @property
    def block_bytes(self) -> int:
        """A block file's size: header, token ids, payload."""
        return HEADER_BYTES + 4 * self.block_size + self.payload_bytes

    @property
    def key(self) -> str:
        """A directory name for this layout: readable, and unique to the model, dtype and shape."""
        digest = hashlib.blake2b(repr((self.model, self.dtype, self.shape)).encode(), digest_size=6).hexdigest()
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model)[-40:]
        return f"{safe}-{self.dtype}-{digest}"


def encode_block(block_hash: int, token_ids: tuple[int, ...], payload: bytes | memoryview,
                 ) -> tuple[bytes, bytes | memoryview]:
    """The file bytes of one block, in two parts (header with token ids, then the payload as given): written
    one after the other, so the payload is never copied to be joined."""
    tokens = array("i", token_ids).tobytes()
    hash_bytes = block_hash.to_bytes(16, "little")
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(hash_bytes)))
    header = _HEADER.pack(MAGIC, VERSION, 0, len(token_ids), crc, len(payload), hash_bytes)
    return header + tokens, payload


def decode_block(data: bytes | bytearray | memoryview, block_hash: int, token_ids: tuple[int, ...], payload_bytes: int,
                 ) -> memoryview:
    """The payload of a block file, after checking it is whole and is the block ``block_hash`` of ``token_ids``;
    raises ``CorruptBlock`` otherwise."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise CorruptBlock(f"{len(view)} bytes: shorter than a header")
    magic, version, _, num_tokens, crc, length, hash_bytes = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a version {VERSION} block file")
    if length != payload_bytes or len(view) != HEADER_BYTES + 4 * num_tokens + length:
        raise CorruptBlock(f"{len(view)} bytes where the header promises {HEADER_BYTES + 4 * num_tokens + length}"
                           f" and the layout {payload_bytes} of payload")
    tokens = view[HEADER_BYTES:HEADER_BYTES + 4 * num_tokens]
    payload = view[HEADER_BYTES + 4 * num_tokens:]
    if zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(hash_bytes))) != crc:
        raise CorruptBlock("checksum mismatch")
    stored = array("i")
    stored.frombytes(tokens)
    if int.from_bytes(hash_bytes, "little") != block_hash or tuple(stored) != token_ids:
        raise CorruptBlock("another block's content")
    return payload
