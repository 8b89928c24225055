"""Token-sequence helpers (`server_tokens::get_common_prefix`) and the two token containers the core keeps.

The core holds every token sequence (prompts, slot contents, prompt-cache entries) in one container type,
chosen per core (`ServerCore(token_arrays=...)`):

- `list` of int (the default; what the engine and the HTTP server hand in and read back);
- `array('i')` (`token_array`): 4 bytes a token, so a copy, slice or concatenation is one memcpy instead of a
  reference-count update per token. The simulator uses it: its prompts run to 10^5 tokens and are copied
  into slots and the prompt cache again and again. Token ids must fit a C int (any real vocabulary does).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

_BLOCK = 64
TOKEN_TYPECODE = "i"


def token_array(tokens: Iterable[int] = ()) -> array:
    """A new `array('i')` of `tokens` (a copy; from another `array('i')` it is one memcpy)."""
    return array(TOKEN_TYPECODE, tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (plain token equality, as upstream).

    Lists: compares 64-token blocks with C-level slice equality and only walks the first differing block
    token by token, so long shared prefixes cost little Python time. Two `array('i')`s: compares blocks
    that double in size (a slice of an array is a memcpy and its equality a C loop), then halves the first
    unequal block. Sequences of different types are compared token by token (correct, only slower: a list
    slice never equals an array slice).
    """
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if type(a) is array and type(b) is array:
        return _common_prefix_arrays(a, b, n)
    i = 0
    while i + _BLOCK <= n and a[i:i + _BLOCK] == b[i:i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_prefix_arrays(a: array, b: array, n: int) -> int:
    """`common_prefix` of two arrays of at least n tokens whose first tokens are equal."""
    lo, size = 1, _BLOCK                # a[:lo] == b[:lo]
    while True:
        hi = lo + size
        if hi >= n:
            hi = n
            if a[lo:n] == b[lo:n]:
                return n
            break
        if a[lo:hi] != b[lo:hi]:
            break
        lo = hi
        size *= 2
    # the first difference lies in [lo, hi)
    while hi - lo > _BLOCK:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo
