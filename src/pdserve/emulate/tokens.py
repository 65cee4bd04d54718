"""Emulated sampling: token i of a sequence = H(tokens 0..i-1, seed) mod vocab.

A function of the whole context, as a real model's greedy token is: a continuation after a
migration (prompt + tokens so far, re-prefilled elsewhere) draws exactly the tokens the lost
worker would have drawn, and a prefill and a decode agree on every token. H is a polynomial
rolling hash mod the Mersenne prime 2^61 - 1, finished by a splitmix64 mix; a sequence's hash
state is kept between steps so each step hashes only its new tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

_M = (1 << 61) - 1
_P = 1_000_003
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def extend(state: int, tokens: Sequence[int]) -> int:
    for t in tokens:
        state = (state * _P + t + 1) % _M
    return state


def token_for(context: Sequence[int], seed: int, vocab_size: int) -> int:
    """The emulated token that follows `context` (stateless reference)."""
    return _mix(extend(0, context) ^ (seed & _MASK)) % vocab_size


class TokenHasher:
    """`next_token(seq)`: the token after seq.all_token_ids, hashing only what is new since
    the last call for that sequence (state per Sequence object, dropped with it)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._state: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()

    def next_token(self, seq: Any) -> int:
        ids = seq.all_token_ids
        n, state = self._state.get(seq, (0, 0))
        if n > len(ids):  # tokens never shrink; be safe anyway
            n, state = 0, 0
        state = extend(state, ids[n:])
        self._state[seq] = (len(ids), state)
        seed = seq.params.seed or 0
        return _mix(state ^ (seed & _MASK)) % self.vocab_size
