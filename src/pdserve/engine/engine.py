"""LLMEngine: the synchronous engine. add_request / step / abort, plus the KV hooks used by
disaggregated workers (prefill-only requests with a per-layer KV sink; reserved blocks that a
decode fills from a remote prefill; block export/import for the kvstore).

Not thread-safe: one thread owns it (AsyncEngine runs every call on its engine thread).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.params import SamplingParams, validate_request
from pdserve.engine.runner import ModelRunner, allocate_kv_caches
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence as Seq
from pdserve.errors import InvalidRequestError, NotFoundError
from pdserve.kv.block_pool import BlockPool
from pdserve.kv.hashing import block_hashes
from pdserve.kv.spec import KVSpec

KVSink = Callable[[int, torch.Tensor], None]  # (layer, kv [n_blocks, 2, bs, kvh, hd])


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | Path
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (loader.auto_dtype: per device)
    device: str = "cpu"
    num_blocks: int | None = None  # wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # default: 1 GiB, capped at what max_num_seqs can use
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = None  # generator for unseeded random sampling


_FINISHED = "#finished"  # key suffix of a finished request's held blocks


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: Any = None) -> None:
        if loaded is None:
            from pdserve.model.loader import load_model

            loaded = load_model(config.model_dir, dtype=config.dtype, device=config.device)
        self.config = config
        self.loaded = loaded
        mc = loaded.config
        self.model_config = mc
        self.vocab_size: int = mc.vocab_size
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids or ())
        self.spec = KVSpec(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            dtype=str(loaded.dtype).removeprefix("torch."),
        )
        self.namespace = self.spec.fingerprint(loaded.fingerprint)
        self.num_blocks = self._num_blocks(config)
        self.pool = BlockPool(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool, config.max_num_batched_tokens, config.max_num_seqs, self.namespace
        )
        gen = None if config.seed is None else torch.Generator().manual_seed(config.seed)
        self.kv_caches = allocate_kv_caches(self.spec, self.num_blocks, config.device)
        self.runner = ModelRunner(
            loaded.model, self.kv_caches, config.block_size, config.device, Sampler(gen)
        )
        self._seqs: dict[str, Seq] = {}
        self._reserved: set[int] = set()  # blocks held by reserve_blocks, not yet a request's
        # request_id -> cached prefix blocks held (one ref each) until that request is
        # scheduled: KV fetched from the kvstore must not be evicted while the request waits
        self._held: dict[str, list[int]] = {}
        # requests whose computed full blocks stay held after they finish, until
        # release_held(): the worker's kvstore write-back reads them off the critical path
        self._hold_on_finish: set[str] = set()
        self._arrival = itertools.count()

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        per_seq = self.spec.num_blocks_for(self.max_model_len)
        if config.kv_cache_bytes is not None:
            return max(1, config.kv_cache_bytes // self.spec.bytes_per_block)
        budget = (1 << 30) // self.spec.bytes_per_block
        return max(per_seq + 1, min(budget, per_seq * config.max_num_seqs))

    # ---- requests ---------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        total = len(prompt_token_ids) + params.max_tokens
        if self.spec.num_blocks_for(total) > self.num_blocks:
            cap = self.num_blocks * self.spec.block_size
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens exceeds this engine's KV capacity "
                f"of {cap} tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        kv_sink: KVSink | None = None,
    ) -> None:
        params = params or SamplingParams()
        try:
            if request_id in self._seqs:
                raise InvalidRequestError("request_id", f"{request_id!r} is already running")
            self.validate(prompt_token_ids, params)
        except InvalidRequestError:
            self.release_held(request_id)
            raise
        seq = Seq(
            request_id,
            list(prompt_token_ids),
            params,
            arrival=next(self._arrival),
            prefill_only=prefill_only,
            kv_sink=kv_sink,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Idempotent. Returns True if the request was live."""
        self.release_held(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan:
            return []
        if self._held:  # scheduled requests now hold their prefix themselves
            for entry in plan.scheduled:
                self._drop_hold(entry.seq.request_id)
        sinks = [e.seq for e in plan.scheduled if e.sample and e.seq.prefill_only and e.seq.kv_sink]
        callback = self._sink_callback(sinks) if sinks else None
        sampled = self.runner.execute(plan, layer_callback=callback)
        outputs = []
        for entry in self.scheduler.update(plan, sampled):
            seq = entry.seq
            reason = self._finish_reason(seq)
            if reason is not None:
                self._finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [seq.output_token_ids[-1]], reason))
        return outputs

    def _sink_callback(self, seqs: list[Seq]) -> Callable[[int], None]:
        def callback(layer: int) -> None:
            for seq in seqs:
                n = self.spec.num_blocks_for(seq.num_tokens)
                assert seq.kv_sink is not None
                seq.kv_sink(layer, self.runner.read_layer(layer, seq.block_table[:n]))

        return callback

    def _finish_reason(self, seq: Seq) -> str | None:
        tok = seq.output_token_ids[-1]
        p = seq.params
        if seq.prefill_only:
            return "prefill_done"
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Seq, new: list[int], reason: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[list[int]]:
        """Convenience: run the prompts to completion, return their generated token ids."""
        ids = [f"gen-{next(self._arrival)}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._seqs for rid in ids):
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id].extend(out.new_token_ids)
        return [result[rid] for rid in ids]

    # ---- disaggregation hooks (engine thread, between steps) ---------------------------
    def reserve_blocks(self, num_tokens: int) -> list[int]:
        """Hold blocks for `num_tokens` tokens of a request whose KV arrives from elsewhere."""
        n = self.spec.num_blocks_for(num_tokens)
        if n > self.pool.num_free_blocks:
            from pdserve.errors import OverloadedError

            raise OverloadedError(f"need {n} KV blocks, {self.pool.num_free_blocks} free")
        blocks = self.pool.allocate(n)
        self._reserved.update(blocks)
        return blocks

    def write_kv(self, block_ids: Sequence[int], layer: int, kv: torch.Tensor) -> None:
        """kv: [n, 2, bs, kvh, hd] with n <= len(block_ids): fills block_ids[:n] of `layer`."""
        ids = list(block_ids)[: kv.shape[0]]
        if not set(ids) <= self._reserved:
            raise InvalidRequestError("block_ids", "write_kv only into reserved blocks")
        self.runner.write_layer(layer, ids, kv)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Release reserved blocks (cancel, lease expiry). Ids not reserved are ignored."""
        ids = [b for b in block_ids if b in self._reserved]
        self._reserved.difference_update(ids)
        self.pool.free(ids)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        block_ids: Sequence[int],
    ) -> RequestOutput | None:
        """Admit a request whose prompt KV is in reserved `block_ids` and whose token 0 was
        sampled elsewhere. The blocks now belong to the request. Returns a finished output
        if token 0 already ends it (else None: tokens 1.. come from step())."""
        if request_id in self._seqs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        if not 0 <= first_token < self.vocab_size:
            raise InvalidRequestError("first_token", f"must be in [0, {self.vocab_size})")
        ids = list(block_ids)
        if not set(ids) <= self._reserved:
            raise NotFoundError("block_ids are not (or no longer) reserved on this engine")
        if len(ids) * self.spec.block_size < len(prompt_token_ids) + 1:
            raise InvalidRequestError("block_ids", "too few blocks for the prompt + 1 token")
        self._reserved.difference_update(ids)
        seq = Seq(request_id, list(prompt_token_ids), params, arrival=next(self._arrival))
        seq.output_token_ids.append(first_token)
        seq.block_table = ids
        seq.num_computed_tokens = len(prompt_token_ids)
        self._seqs[request_id] = seq
        self.scheduler.add_running(seq)
        reason = self._finish_reason(seq)
        if reason is None:
            return None
        self._finish(seq, reason)
        del self._seqs[request_id]
        return self._output(seq, [], reason)

    def compute_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` in this engine's namespace."""
        return block_hashes(token_ids, self.spec.block_size, self.namespace)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest locally cached prefix of `hashes` (no refs taken)."""
        return self.pool.find_prefix(hashes, record=False)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[n, L, 2, bs, kvh, hd] CPU copy of the given blocks (all layers)."""
        return self.runner.read_blocks(list(block_ids))

    def import_cached_blocks(self, hashes: Sequence[bytes], data: torch.Tensor) -> int:
        """Insert blocks fetched from the kvstore into the prefix cache. data:
        [n, L, 2, bs, kvh, hd] for `hashes` (a chain in this namespace). Blocks already
        cached are skipped. Returns the number inserted; they stay free (ref 0) and cached."""
        if data.shape[0] != len(hashes) or data.shape[1] != self.spec.num_layers:
            raise InvalidRequestError("data", f"expected [{len(hashes)}, L, ...] got {data.shape}")
        todo = [i for i, h in enumerate(hashes) if self.pool.lookup(h) is None]
        todo = todo[: self.pool.num_free_blocks]
        if not todo or not self.pool.enable_prefix_caching:
            return 0
        blocks = self.pool.allocate(len(todo))
        for layer in range(self.spec.num_layers):
            self.runner.write_layer(layer, blocks, data[todo, layer])
        for b, i in zip(blocks, todo, strict=True):
            self.pool.cache_block(b, hashes[i])
        self.pool.free(blocks)
        return len(todo)

    def stats(self) -> dict[str, float]:
        """Load and cache counters (for heartbeats / metrics)."""
        st = self.pool.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_reserved_blocks": len(self._reserved),
            "num_cached_blocks": self.pool.num_cached_blocks,
            "prefix_hit_blocks": st.hit_blocks,
            "prefix_hit_tokens": st.hit_tokens,
            "prefix_queried_blocks": st.queries_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
        }

    def hold_prefix(self, request_id: str, hashes: Sequence[bytes]) -> int:
        """Take one ref on each block of the longest locally cached prefix of `hashes` until
        `request_id` is scheduled (or aborted), so eviction cannot break the prefix while the
        request waits. Returns the blocks held."""
        blocks = self.pool.find_prefix(hashes, record=False)
        self.pool.touch(blocks)
        self._held.setdefault(request_id, []).extend(blocks)
        return len(blocks)

    def hold_on_finish(self, request_id: str) -> None:
        """When `request_id` finishes normally, keep its computed full blocks (cached, one ref
        each) until `release_held(request_id)`."""
        self._hold_on_finish.add(request_id)

    def release_held(self, request_id: str) -> None:
        """Drop every hold of `request_id`: its waiting prefix and its finished blocks."""
        self._hold_on_finish.discard(request_id)
        self._drop_hold(request_id)
        self._drop_hold(request_id + _FINISHED)

    def _drop_hold(self, key: str) -> None:
        blocks = self._held.pop(key, None)
        if blocks:
            self.pool.free(blocks)

    def _finish(self, seq: Seq, reason: str) -> None:
        if seq.request_id in self._hold_on_finish:
            self._hold_on_finish.discard(seq.request_id)
            if reason != "abort":
                n = min(seq.num_computed_tokens // self.spec.block_size, len(seq.block_table))
                blocks = seq.block_table[:n]
                self.pool.touch(blocks)  # the sequence's own refs go in finish()
                self._held[seq.request_id + _FINISHED] = blocks
        self.scheduler.finish(seq, reason)

    # ---- checks -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned: dict[int, int] = {}
        for seq in self.scheduler.iter_all():
            for b in seq.block_table:
                owned[b] = owned.get(b, 0) + 1
        for b in self._reserved:
            owned[b] = owned.get(b, 0) + 1
        for blocks in self._held.values():
            for b in blocks:
                owned[b] = owned.get(b, 0) + 1
        for b, rc in enumerate(self.pool.ref_counts):
            assert rc == owned.get(b, 0), f"block {b}: ref {rc} but {owned.get(b, 0)} owners"
