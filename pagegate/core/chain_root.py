"""The root of a prefix chain: the parent hash of a sequence's first page, naming everything beside the tokens that
a page's KV depends on or that must keep two requests' pages apart."""

from __future__ import annotations

import hashlib
import struct

_TAG = b"PGROOT1\0"


def chain_root(model: str, adapter: str | None = None, salt: str | None = None, tenant: str | None = None) -> int:
    """The first 8 bytes (little-endian) of SHA-256 over a length-prefixed record of the model identity, the
    LoRA adapter's identity, the client's cache salt and the tenant (API key identity).

    NOTE: each field is a presence byte, a u32 length and its UTF-8 bytes, so no two different tuples share a
    record ("a" + "\\0b" is not "a\\0" + "b", None is not ""), and SHA-256 leaves no salt that aims at a chosen
    root: a client's salt or adapter can never make its pages another request's prefix hits.
    """
    digest = hashlib.sha256(_TAG)
    for field in (model, adapter, salt, tenant):
        if field is None:
            digest.update(b"\0")
            continue
        data = field.encode("utf-8", "surrogatepass")
        digest.update(b"\1" + struct.pack("<I", len(data)) + data)
    return int.from_bytes(digest.digest()[:8], "little")
