"""Slot save/restore files and filename validation (`llama_state_seq_save_file` / `_load_file`,
`fs_validate_filename` of llama.cpp).

File format (little-endian), version 1:

    offset  size          field
    0       4             magic b"SLSQ"
    4       4   u32       version (1)
    8       4   u32       n_tokens
    12      4*n i32[n]    token ids of the slot's prompt (what its KV cells hold, in order)
    ..      8   u64       state_len
    ..      state_len     the sequence's KV state (engine.model.kv `state_save` blob: its own header,
                          positions, K and V)

The format is slotlab's own: llama.cpp's 'ggsq' files hold ggml tensors and cannot be read here.
"""

from __future__ import annotations

import os
import struct
import unicodedata
from dataclasses import dataclass

MAGIC = b"SLSQ"
VERSION = 1
_HEAD = struct.Struct("<4sII")
_LEN = struct.Struct("<Q")
MAX_FILENAME_BYTES = 255


class SlotFileError(ValueError):
    """The file cannot be restored (the message follows "Unable to restore slot: ")."""


def validate_filename(name: object) -> bool:
    """Like `fs_validate_filename`: a plain file name, no directories, no tricks."""
    if not isinstance(name, str) or not name:
        return False
    if len(name.encode("utf-8", errors="surrogatepass")) > MAX_FILENAME_BYTES:
        return False
    if name in (".", "..") or ".." in name:
        return False
    if name != name.strip() or name.endswith("."):
        return False
    for ch in name:
        cp = ord(ch)
        if cp < 0x20 or cp == 0x7F or 0xD800 <= cp <= 0xDFFF or cp in (0xFFFD, 0xFEFF):
            return False
        if ch in '/\\:*?"<>|':
            return False
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return False
    return not os.path.isabs(name)


def encode(tokens: list[int], state: bytes) -> bytes:
    n = len(tokens)
    return b"".join([_HEAD.pack(MAGIC, VERSION, n), struct.pack(f"<{n}i", *tokens), _LEN.pack(len(state)), state])


@dataclass(frozen=True, slots=True)
class SlotFile:
    tokens: list[int]
    state: bytes
    n_read: int


def decode(data: bytes) -> SlotFile:
    """Parse a slot file; any inconsistency raises SlotFileError (nothing is applied by this function)."""
    if len(data) < _HEAD.size:
        raise SlotFileError("file too short")
    magic, version, n = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise SlotFileError("invalid slot save file (bad magic)")
    if version != VERSION:
        raise SlotFileError(f"unsupported slot save file version {version}")
    off = _HEAD.size
    end_tokens = off + 4 * n
    if end_tokens + _LEN.size > len(data):
        raise SlotFileError("file truncated (token list)")
    tokens = list(struct.unpack_from(f"<{n}i", data, off))
    (state_len,) = _LEN.unpack_from(data, end_tokens)
    start = end_tokens + _LEN.size
    if start + state_len != len(data):
        raise SlotFileError(f"file truncated or corrupt (state of {state_len} bytes, "
                            f"{len(data) - start} present)")
    return SlotFile(tokens, data[start:], len(data))
