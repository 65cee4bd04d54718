"""AttentionMetadata: what one model step needs to know about its flattened token batch.

The batch is B sequences, their new tokens concatenated (no padding): sequence i owns
tokens `query_start_loc[i]:query_start_loc[i+1]` of `input_ids[T]`. A sequence may be a
prefill chunk (query_len > 1, possibly after cached context) or a decode (query_len == 1);
they can appear in any order. Backends derive their own per-step plans from this once per
forward (not per layer).

`window`: with a sliding window group (pdserve.kv.window_group: Gemma 4's sliding layers in
their own block pool) the same batch addressed through each sequence's window table: its
own slot_mapping and block_tables (entries before the window are the null block, zero and
never written). A model runs its sliding layers with `meta.window or meta`; a backend needs
no change (it plans from whichever metadata it is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    block_size: int
    # host copies (the torch backend plans from these without device syncs)
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]]
    num_prefill_tokens: int = 0  # tokens of sequences with query_len > 1
    num_decode_tokens: int = 0  # tokens of sequences with query_len == 1
    extras: dict[str, Any] = field(default_factory=dict)  # backend-specific, optional
    window: AttentionMetadata | None = None  # the sliding group's tables (see module doc)

    def k_rows(self) -> torch.Tensor:
        """[T] int64: each new token's K row in a paged cache [num_blocks, 2, bs, ...] viewed
        flat as [num_blocks * 2 * bs, ...]; its V row is this + block_size. (A slot is
        block * bs + offset, its K row block * 2bs + offset.)"""
        slots = self.slot_mapping.to(torch.int64)
        return slots + (slots // self.block_size) * self.block_size

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        window_block_tables: Sequence[Sequence[int]] | None = None,
    ) -> AttentionMetadata:
        """Build metadata from host lists. Sequence i's new tokens sit at positions
        `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`; its block table must cover
        `ceil(seq_lens[i] / block_size)` blocks (its window table too, when given)."""
        window = None
        if window_block_tables is not None:
            window = cls.build(query_lens, seq_lens, window_block_tables, block_size, device)
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables differ in length")
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 1 <= q <= s:
                raise ValueError(f"need 1 <= query_len <= seq_len, got {q}, {s}")
            if len(table) * block_size < s:
                raise ValueError(f"block table of {len(table)} blocks too short for {s} tokens")
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        n_prefill = sum(q for q in query_lens if q > 1)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(padded), width
            ),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_tables_cpu=[list(t) for t in block_tables],
            num_prefill_tokens=n_prefill,
            num_decode_tokens=sum(query_lens) - n_prefill,
            window=window,
        )
