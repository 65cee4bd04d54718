"""Colocated role: both phases of a request on this worker, chunked prefill in the same
continuous batch, with optional kvstore prefix fetch before and write-back after."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.worker.domain import StageCosts, TokenEvent
from pdserve.worker.kv_reuse import KVReuse


class ColocatedHandler:
    def __init__(self, engine: AsyncEngine, kv_reuse: KVReuse) -> None:
        self._engine = engine
        self._kv_reuse = kv_reuse

    async def generate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        use_kvstore: bool = False,
        write_back: bool = False,
    ) -> AsyncIterator[TokenEvent]:
        stages = StageCosts()
        reuse = self._kv_reuse
        fetch = use_kvstore and reuse.enabled
        hold = write_back and reuse.enabled
        generated: list[int] = []
        finished = False
        try:
            if fetch:
                stages.kvstore_tokens = await reuse.fetch_prefix(request_id, token_ids, hold)
            async for ev in self._events(request_id, token_ids, params, stages, hold and not fetch):
                generated.extend(ev.token_ids)
                finished = ev.finish_reason not in (None, "abort")
                yield ev
        except BaseException:
            self._engine.abort_nowait(request_id)  # releases every hold of the request
            raise
        finally:
            if fetch or hold:
                reuse.finish(request_id, [*token_ids, *generated], hold and finished)

    async def _events(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        stages: StageCosts,
        hold_on_finish: bool,
    ) -> AsyncIterator[TokenEvent]:
        started = time.perf_counter()
        first_at: float | None = None
        outputs = self._engine.generate(
            request_id, token_ids, params, hold_on_finish=hold_on_finish
        )
        async for out in outputs:
            now = time.perf_counter()
            if first_at is None and out.new_token_ids:
                first_at = now
                stages.prefill_ms = (now - started) * 1e3
                stages.cached_tokens = out.num_cached_tokens
            if out.finished:
                stages.decode_ms = (now - (first_at or now)) * 1e3
                yield TokenEvent(out.new_token_ids, out.finish_reason, stages)
                return
            yield TokenEvent(out.new_token_ids)
