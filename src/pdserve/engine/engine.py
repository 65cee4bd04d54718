"""LLMEngine: the synchronous engine. add_request / step / abort, plus the KV hooks used by
disaggregated workers (prefill-only requests with a per-layer KV sink; reserved blocks that a
decode fills from a remote prefill; block export/import for the kvstore).

Not thread-safe: one thread owns it (AsyncEngine runs every call on its engine thread).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.engine.backend import ForwardBackend, Runner
from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.params import SamplingParams, validate_request
from pdserve.engine.scheduler import Scheduler, SchedulerPlan
from pdserve.engine.sequence import Sequence as Seq
from pdserve.errors import InvalidRequestError, NotFoundError
from pdserve.kv.cache_manager import KVCacheManager
from pdserve.kv.window_group import lone_request_blocks, window_pool_sizes

KVSink = Callable[[int, Any], None]  # (layer, kv [n_blocks, 2, bs, kvh, hd])


class LLMEngine:
    def __init__(
        self, config: EngineConfig, loaded: Any = None, backend: ForwardBackend | None = None
    ) -> None:
        """`backend` chooses the forward pass (engine.backend); default: the real one over
        `loaded` (a LoadedModel; loaded from config.model_dir when None)."""
        if backend is None:
            if loaded is None:
                from pdserve.model.loader import load_model

                loaded = load_model(config.model_dir, dtype=config.dtype, device=config.device)
            from pdserve.engine.torch_backend import TorchBackend

            backend = TorchBackend(loaded)
        self.config = config
        self.backend = backend
        self.loaded = loaded if loaded is not None else backend  # .config, .fingerprint
        mc = backend.config
        self.model_config = mc
        self.vocab_size: int = mc.vocab_size
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids or ())
        self.dtype: str = backend.dtype  # compute dtype served (spec.dtype is the KV's)
        self.spec = backend.kv_spec(config.block_size, config.kv_dtype)
        if self.spec.quantized and not str(config.device).startswith("cpu"):
            raise ValueError(f"kv_dtype {config.kv_dtype}: only the torch (CPU) backend reads it")
        self.kv_fingerprint = self.spec.kv_fingerprint(backend.fingerprint)
        # the sliding window group (None: one pool for every layer, today's layout)
        self.window = self.spec.window_group if config.window_pool else None
        self.num_blocks, self.num_window_blocks = self._num_blocks(config)
        self.kv = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.kv_fingerprint,
            window=self.window,
            window_blocks=self.num_window_blocks,
        )
        self.last_plan: SchedulerPlan | None = None  # the step's plan, its KV pushes
        self.last_pushes = 0
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.chunked_prefill
        )
        if self.window is None:
            self.runner: Runner = backend.make_runner(self.spec, self.num_blocks, config)
        else:
            self.runner = backend.make_runner(  # type: ignore[call-arg]
                self.spec, self.num_blocks, config, window_blocks=self.num_window_blocks
            )
        # what the forward pass runs (pdserve.model.kernels.KernelSelection; None: emulated)
        self.kernels: Any = getattr(self.runner, "kernels", None)
        # stored layer -> True when it lives in the window group
        self._in_window = [
            self.window is not None and self.spec.in_window_group(i)
            for i in range(self.spec.num_layers)
        ]
        self._seqs: dict[str, Seq] = {}
        self._arrival = itertools.count()

    def _num_blocks(self, config: EngineConfig) -> tuple[int, int]:
        """(main pool blocks, window pool blocks; 0 without a window group)."""
        if self.window is None:
            return self._one_pool_blocks(config, self.spec.bytes_per_block), 0
        chunk = config.max_num_batched_tokens
        step = chunk if config.chunked_prefill else max(chunk, self.max_model_len)
        n, n_w = window_pool_sizes(
            self.spec.group_block_bytes(),
            config.block_size,
            self.window,
            step_tokens=step,
            max_num_seqs=config.max_num_seqs,
            kv_cache_bytes=config.kv_cache_bytes,
            num_blocks=config.num_blocks,
            window_blocks=config.window_blocks,
            default_blocks=self._one_pool_blocks(config, self.spec.bytes_per_block),
            max_model_len=self.max_model_len,
        )
        lone = lone_request_blocks(config.block_size, self.window, step)
        if n_w < min(n, lone):  # a lone long prompt could never run
            raise ValueError(
                f"window_blocks={n_w}: one request can need {lone} window blocks "
                f"(window {self.window} + a step of {step} tokens)"
            )
        return n, n_w

    def _one_pool_blocks(self, config: EngineConfig, bytes_per_block: int) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        per_seq = self.spec.num_blocks_for(self.max_model_len)
        if config.kv_cache_bytes is not None:
            return max(1, config.kv_cache_bytes // bytes_per_block)
        budget = (1 << 30) // bytes_per_block
        return max(per_seq + 1, min(budget, per_seq * config.max_num_seqs))

    def _table(self, layer: int, block_table: list[int], window_table: list[int]) -> list[int]:
        """The table stored `layer` reads: the window group's or the main one."""
        return window_table if self._in_window[layer] else block_table

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
            self.kv.release(request_id)
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
        """Stop `request_id` and drop everything it owns (reservation, holds). Idempotent.
        Returns True if it was live (a sequence, or blocks held for it)."""
        live = self.kv.release(request_id) > 0
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return live
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
        sinks = [e.seq for e in plan.scheduled if e.sample and e.seq.prefill_only and e.seq.kv_sink]
        callback = self._sink_callback(sinks) if sinks else None
        self.last_plan, self.last_pushes = plan, len(sinks)  # for the step log
        sampled = self.runner.execute(plan, layer_callback=callback)
        outputs = []
        for entry in self.scheduler.update(plan, sampled):
            seq = entry.seq
            reason = self._finish_reason(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [seq.output_token_ids[-1]], reason))
        return outputs

    def _sink_callback(self, seqs: list[Seq]) -> Callable[[int], None]:
        def callback(layer: int) -> None:
            for seq in seqs:
                # sliding layers send their last window only (KVSpec.first_needed_block)
                n = self.spec.num_blocks_for(seq.num_tokens)
                first = self.spec.first_needed_block(layer, seq.num_tokens)
                assert seq.kv_sink is not None
                table = self._table(layer, seq.block_table, seq.window_table)
                seq.kv_sink(layer, self.runner.read_layer(layer, table[first:n]))

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
    def reserve(self, request_id: str, num_tokens: int, num_kv_tokens: int = 0) -> list[int]:
        """Reserve blocks for `num_tokens` tokens of `request_id`, whose KV (of its first
        `num_kv_tokens` tokens: the prompt) arrives from elsewhere; a window group reserves
        that KV's window only. Freed by `add_prefilled_request` (they become the
        sequence's), `release` or `abort_request`."""
        return self.kv.reserve(request_id, num_tokens, num_kv_tokens)

    def write_kv(self, request_id: str, layer: int, kv: Any, num_tokens: int | None = None) -> None:
        """kv: [n, 2, bs, kvh, hd] of stored `layer`: fills reserved blocks first..first+n-1
        of `request_id`, where first = spec.first_needed_block(layer, num_tokens) (a sliding
        layer's transfer starts at its window; None = 0)."""
        ids = self.kv.reserved_blocks(request_id, window=self._in_window[layer])
        first = 0 if num_tokens is None else self.spec.first_needed_block(layer, num_tokens)
        if len(ids) < first + kv.shape[0]:
            raise NotFoundError(f"{request_id!r} has no reservation for {kv.shape[0]} blocks")
        self.runner.write_layer(layer, ids[first : first + kv.shape[0]], kv)

    def release(self, request_id: str) -> int:
        """Free the reservation and holds of `request_id` (not a running sequence).
        Idempotent. Returns the blocks released."""
        return self.kv.release(request_id)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
    ) -> RequestOutput | None:
        """Admit a request whose prompt KV is in its reserved blocks and whose token 0 was
        sampled elsewhere. The blocks now belong to the request. Returns a finished output
        if token 0 already ends it (else None: tokens 1.. come from step())."""
        if request_id in self._seqs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        if not 0 <= first_token < self.vocab_size:
            raise InvalidRequestError("first_token", f"must be in [0, {self.vocab_size})")
        reserved = self.kv.reserved_blocks(request_id)
        if not reserved:
            raise NotFoundError(f"{request_id!r} has no (or no longer a) reservation here")
        if len(reserved) * self.spec.block_size < len(prompt_token_ids) + 1:
            raise InvalidRequestError("block_ids", "too few blocks for the prompt + 1 token")
        seq = Seq(request_id, list(prompt_token_ids), params, arrival=next(self._arrival))
        seq.output_token_ids.append(first_token)
        seq.num_computed_tokens = len(prompt_token_ids)
        if self.window is not None:
            # the window entries whose KV did not travel become NULL (never registered)
            self.kv.admit_reservation(seq, len(prompt_token_ids))
        else:
            seq.block_table = self.kv.claim_reservation(request_id)
            # blocks whose sliding layers did not travel (outside the window) are never
            # offered as cached prefix: register_computed starts past them
            seq.num_registered_blocks = self.spec.trimmed_blocks(len(prompt_token_ids))
        self._seqs[request_id] = seq
        self.scheduler.add_running(seq)
        reason = self._finish_reason(seq)
        if reason is None:
            return None
        self.scheduler.finish(seq, reason)
        del self._seqs[request_id]
        return self._output(seq, [], reason)

    def compute_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` under this engine's kv_fingerprint."""
        return self.kv.compute_block_hashes(token_ids)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest locally cached prefix of `hashes` (no refs taken)."""
        return self.kv.cached_prefix(hashes)

    def empty_kv(self, shape: Sequence[int]) -> Any:
        """An uninitialised CPU buffer of the KV dtype (any thread: it touches no state)."""
        return self.runner.empty_kv(shape)

    def read_blocks(self, block_ids: Sequence[int], window_ids: Sequence[int] = ()) -> Any:
        """CPU copy of the given blocks (every stored layer; a window group's layers from
        `window_ids`, the same logical blocks in its pool), shaped spec.blocks_shape(n):
        [n, L, 2, bs, kvh, hd] for uniform models, else [n, elems_per_block]."""
        if self.window is None:
            data = self.runner.read_blocks(list(block_ids))
        else:
            tables = [
                self._table(i, list(block_ids), list(window_ids))
                for i in range(self.spec.num_layers)
            ]
            data = self.runner.read_blocks(list(block_ids), per_layer=tables)  # type: ignore[call-arg]
        return data.reshape(self.spec.blocks_shape(len(block_ids)))

    def layer_views(self, data: Any) -> list[Any]:
        """Per stored layer a [n, 2, bs, kvh_l, hd_l] view of blocks shaped spec.blocks_shape(n)."""
        n = data.shape[0]
        flat = data.reshape(n, -1)
        return [
            flat[:, a:b].reshape(n, *self.spec.layer_block_shape(i))
            for i, (a, b) in enumerate(self.spec.layer_offsets())
        ]

    def read_cached(self, hashes: Sequence[bytes], skip: int) -> Any:
        """The locally cached blocks of the chain `hashes` past its first `skip` ones, read
        in one go (nothing can evict them in between); None when there are none."""
        local, window = self.kv.cached_run(hashes, skip)
        return self.read_blocks(local, window) if local else None

    def import_cached_blocks(self, hashes: Sequence[bytes], data: Any, window_from: int = 0) -> int:
        """Insert blocks fetched from the kvstore into the prefix cache. data:
        [n, L, 2, bs, kvh, hd] for `hashes` (a chain under this kv_fingerprint). Blocks already
        cached are skipped. Returns the number inserted; they stay free (ref 0) and cached.
        `window_from` > 0: the sliding layers of blocks before it hold no KV (a layered
        kvstore hit, kv/store_parts.py): only the window group's pool can take such blocks."""
        if tuple(data.shape) != self.spec.blocks_shape(len(hashes)):
            want = list(self.spec.blocks_shape(len(hashes)))
            raise InvalidRequestError("data", f"expected {want} got {list(data.shape)}")
        layers = self.layer_views(data)

        def writer(window: bool):
            def write(blocks: list[int], indices: list[int]) -> None:
                for layer, view in enumerate(layers):
                    if self._in_window[layer] == window:
                        self.runner.write_layer(layer, blocks, view[indices])

            return write

        if self.window is None:
            if window_from:
                raise InvalidRequestError("window_from", "this engine has no window pool")
            return self.kv.import_blocks(hashes, writer(False))
        return self.kv.import_blocks(hashes, writer(False), writer(True), window_from)

    def hold_prefix(self, request_id: str, hashes: Sequence[bytes]) -> int:
        """Hold the longest locally cached prefix of `hashes` until `request_id` is scheduled
        (or released / aborted). Returns the blocks held."""
        return self.kv.hold_prefix(request_id, hashes)

    def hold_on_finish(self, request_id: str) -> None:
        """When `request_id` finishes normally, keep its computed full blocks (cached, one ref
        each) until `release(request_id)`."""
        self.kv.hold_on_finish(request_id)

    def stats(self) -> dict[str, float]:
        """Load and cache counters (for heartbeats / metrics)."""
        st = self.kv.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_window_blocks": self.kv.num_window_blocks,
            "num_free_window_blocks": self.kv.num_free_window_blocks,
            "num_reservations": self.kv.num_reservations,
            "num_reserved_blocks": self.kv.num_reserved_blocks,
            "num_held_blocks": self.kv.num_held_blocks,
            "num_cached_blocks": self.kv.num_cached_blocks,
            "prefix_hit_blocks": st.hit_blocks,
            "prefix_hit_tokens": st.hit_tokens,
            "prefix_queried_blocks": st.queries_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
        }

    # ---- checks -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.iter_all())


def step_shape(plan: SchedulerPlan, pushes: int) -> dict[str, int]:
    """What a step holds, for the step log (`engine.step_log`)."""
    news = [e.num_new_tokens for e in plan.scheduled]
    return {
        "tokens": sum(news),
        "seqs": len(news),
        "chunks": sum(1 for n in news if n > 1),
        "ctx": sum(e.start + e.num_new_tokens for e in plan.scheduled),
        "pushes": pushes,
    }
