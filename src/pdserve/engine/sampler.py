"""Sampling: greedy / temperature / top-k / top-p, with position-derived per-request seeds.

Seeded rows draw their noise from a generator seeded by `derive_seed(seed, i)` where i is the
index of the token being sampled in the request's output, so a token sampled on any engine
(prefill samples token 0, decode the rest) is the same draw. Sampling uses the exponential race
(argmax of p / q with q ~ Exp(1)), which is equivalent to drawing from p.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.params import SamplingParams


def derive_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed from (request seed, output token index)."""
    data = f"pdserve-sample|{seed}|{index}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class SampleRequest:
    params: SamplingParams
    output_index: int  # index of the token being sampled within the request's output


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for unseeded rows; None = torch's default generator

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> list[int]:
        """logits: [N, V] float32 -> one token id per row."""
        n = logits.shape[0]
        assert n == len(reqs)
        out = torch.empty(n, dtype=torch.long)
        greedy_rows = [i for i, r in enumerate(reqs) if r.params.greedy]
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows)
            out[idx] = logits[idx].argmax(dim=-1).cpu()
        if random_rows:
            idx = torch.tensor(random_rows)
            probs = self._probs(logits[idx].float(), [reqs[i].params for i in random_rows])
            noise = self._noise(probs.shape, [reqs[i] for i in random_rows])
            out[idx] = (probs.cpu() / noise).argmax(dim=-1)
        return out.tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # logits: [M, V]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        logits = logits / temps.to(logits.device).unsqueeze(1)
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            vocab = logits.shape[1]
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).to(logits.device).unsqueeze(1))  # [M, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass before it already reaches top_p (keeps the first)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = before >= p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)

    def _noise(self, shape: torch.Size, reqs: list[SampleRequest]) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32)
        unseeded = [i for i, r in enumerate(reqs) if r.params.seed is None]
        if unseeded:
            rows = torch.empty((len(unseeded), shape[1]), dtype=torch.float32)
            rows.exponential_(generator=self.generator)
            noise[torch.tensor(unseeded)] = rows
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                index = r.params.output_offset + r.output_index  # continues a migrated stream
                g = torch.Generator().manual_seed(derive_seed(r.params.seed, index))
                noise[i].exponential_(generator=g)
        return noise.clamp_min_(1e-20)
