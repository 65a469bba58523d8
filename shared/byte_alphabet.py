"""GPT-2's byte alphabet: the printable character byte-level BPE vocabularies spell each byte with,
and the way back from a token's spelling to its bytes."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: the spelling of byte-level vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@lru_cache(maxsize=1)
def byte_translation() -> dict[int, int]:
    """str.translate's table from the byte-level alphabet to latin-1 (character n is byte n), so a
    token's bytes are token.translate(t).encode("latin-1"). Characters of 0-255 outside the
    alphabet map to U+0100, which latin-1 cannot encode, as it cannot any other character outside
    it: such a token (an added one) is taken as UTF-8 text."""
    table = {ord(c): b for b, c in byte_alphabet().items()}
    for n in range(256):
        table.setdefault(n, 0x100)
    return table
