"""Token-sequence helpers (`server_tokens::get_common_prefix`)."""

from __future__ import annotations

from collections.abc import Sequence

_BLOCK = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (plain token equality, as upstream).

    Compares 64-token blocks with C-level slice equality and only walks the first differing block token
    by token, so long shared prefixes cost little Python time. Both arguments must be the same sequence
    type (the core keeps every token sequence as a `list`): a list slice never equals a tuple slice.
    """
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    i = 0
    while i + _BLOCK <= n and a[i:i + _BLOCK] == b[i:i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i
