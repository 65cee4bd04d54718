"""WorkerCore: one process's engine, UCX transport and role state.

The role (prefill | decode | colocated) is state, not identity: `set_role` waits until the
work of the current role is done, then switches; the next heartbeat tells the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import UnavailableError
from pdserve.kv.transfer import UcxTransport
from pdserve.load import LoadReport
from pdserve.logging import get_logger
from pdserve.worker.decode import DecodeHandler
from pdserve.worker.domain import StageCosts, Ticket, TokenEvent
from pdserve.worker.prefill import PrefillHandler
from pdserve.worker.settings import RoleName, WorkerSettings

if TYPE_CHECKING:
    from pdserve.worker.kv_reuse import KVReuse

_log = get_logger(__name__)


class WorkerCore:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.instance_id = settings.instance_id
        self.role: RoleName = settings.role
        self.state = "starting"  # starting -> serving <-> flipping -> draining
        self.model_dir = ""
        self._inflight = 0
        self._tokens_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.engine: AsyncEngine | None = None
        self.transport: UcxTransport | None = None
        self.prefill_handler: PrefillHandler | None = None
        self.decode_handler: DecodeHandler | None = None
        self.kv_reuse = None  # KVReuse, once a kvstore address is known

    # ------------------------------------------------------------------ life
    async def load(self) -> None:
        self.model_dir = self.settings.model or await asyncio.to_thread(_builtin_tiny)
        llm = await asyncio.to_thread(LLMEngine, self._engine_config())
        self.engine = AsyncEngine(llm)
        self.transport = await UcxTransport.create()
        self.decode_handler = DecodeHandler(
            self.engine, self.transport, llm.spec, llm.namespace, self.instance_id,
            self.settings.lease_s,
        )  # fmt: skip
        self.prefill_handler = PrefillHandler(
            self.engine, self.transport, llm.spec, llm.namespace,
            self.settings.transfer_timeout_s,
        )  # fmt: skip
        self.state = "serving"
        _log.info(
            "worker loaded", role=self.role, model=self.model_dir, blocks=llm.num_blocks,
            block_size=llm.spec.block_size, kv_fingerprint=llm.namespace[:16],
        )  # fmt: skip

    def _engine_config(self) -> EngineConfig:
        s = self.settings
        if s.threads:
            import torch

            torch.set_num_threads(s.threads)
        return EngineConfig(
            model_dir=self.model_dir,
            dtype=s.dtype,
            device=s.device,
            num_blocks=s.num_blocks,
            kv_cache_bytes=s.kv_cache_bytes,
            block_size=s.block_size,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            enable_prefix_caching=s.enable_prefix_caching,
        )

    async def drain(self) -> None:
        """Stop taking work; wait for what is in flight, reservations included."""
        self.state = "draining"
        await self._wait_quiet()

    def attach_kvstore(self, addr: str) -> None:
        """Use the kvstore at `addr` for prefix reuse and write-back (idempotent)."""
        if self.kv_reuse is not None or self.engine is None or self.transport is None:
            return
        from pdserve.worker.kv_reuse import KVReuse

        self.kv_reuse = KVReuse(addr, self.engine, self.transport, self.settings.kvstore_timeout_s)
        if self.prefill_handler is not None:
            self.prefill_handler.kv_reuse = self.kv_reuse
        if self.decode_handler is not None:
            self.decode_handler.hold_finished = True  # keep finished blocks for write-back
        _log.info("kvstore attached", addr=addr)

    async def drain_for_rpc(self) -> int:
        """The Drain RPC: stop taking work now, report what is still in flight."""
        self.state = "draining"
        return self._inflight

    async def close(self) -> None:
        if self.decode_handler is not None:
            await self.decode_handler.release_all()
        if self.kv_reuse is not None:
            await self.kv_reuse.close()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.transport is not None:
            await self.transport.close()

    @property
    def llm(self) -> LLMEngine:
        assert self.engine is not None, "worker not loaded"
        return self.engine.engine

    # ------------------------------------------------------------------ roles
    async def set_role(self, role: RoleName) -> RoleName:
        if role == self.role:
            return role
        if self.state != "serving":
            raise UnavailableError(f"worker is {self.state}; cannot change role now")
        self.state = "flipping"
        try:
            await self._wait_quiet()
            assert self.decode_handler is not None
            await self.decode_handler.release_all()  # nothing left by now; kept as a guard
            _log.info("role changed", old=self.role, new=role)
            self.role = role
        finally:
            self.state = "serving"
        return role

    async def _wait_quiet(self) -> None:
        """Until no request runs here and no reservation waits for its Decode: a ticket
        between Reserve and Decode is in-flight work too (its prefill is running elsewhere).
        Bounded: every reservation ends by admission, abort or lease expiry."""
        handler = self.decode_handler
        while self._inflight or (handler is not None and handler.num_reserved):
            if self._inflight:
                await self._idle.wait()
            else:
                await asyncio.sleep(0.02)  # reservations have no event of their own

    def _admit(self, *roles: str, finishing: bool = False) -> None:
        """`finishing`: the call completes work accepted earlier (a Decode of a ticket this
        worker issued), so it is admitted while flipping or draining; new work is not."""
        allowed = ("serving", "flipping", "draining") if finishing else ("serving",)
        if self.state not in allowed:
            raise UnavailableError(f"worker {self.instance_id} is {self.state}")
        if self.role not in roles:
            # UNAVAILABLE, not FAILED_PRECONDITION: the router's view of a role can lag one
            # heartbeat behind a flip; it retries such a request on another instance.
            raise UnavailableError(
                f"worker {self.instance_id} is in role {self.role}, not {'/'.join(roles)}"
            )

    @contextlib.contextmanager
    def _track(self, num_tokens: int) -> Iterator[None]:
        """Count a request (and its prompt tokens) as in flight on this worker."""
        self._inflight += 1
        self._tokens_in_flight += num_tokens
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            self._tokens_in_flight -= num_tokens
            if self._inflight == 0:
                self._idle.set()

    # ------------------------------------------------------------------ requests
    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        lease_s: float,
        prompt_token_ids: Sequence[int] = (),
        params: SamplingParams | None = None,
    ) -> Ticket:
        """With the prompt and sampling, the request is admitted as soon as its KV and token 0
        arrive (early admission); the Decode call then only collects its tokens."""
        self._admit("decode", "colocated")
        assert self.decode_handler is not None
        return await self.decode_handler.reserve(
            request_id, num_prompt_tokens, lease_s or None, prompt_token_ids, params
        )

    async def prefill(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        ticket: Ticket,
        use_kvstore: bool,
    ) -> tuple[int, StageCosts]:
        self._admit("prefill", "colocated")
        assert self.prefill_handler is not None
        with self._track(len(token_ids)):
            return await self.prefill_handler.prefill(
                request_id, token_ids, params, ticket, use_kvstore and self.kv_reuse is not None
            )

    async def decode(
        self,
        request_id: str,
        ticket_id: int,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        write_back: bool = False,
    ) -> AsyncIterator[TokenEvent]:
        self._admit("decode", "colocated", finishing=True)
        assert self.decode_handler is not None
        generated = [first_token]
        finished = False
        try:
            with self._track(len(prompt_token_ids)):
                async for ev in self.decode_handler.decode(
                    request_id, ticket_id, prompt_token_ids, first_token, params
                ):
                    generated.extend(ev.token_ids)
                    finished = ev.finish_reason not in (None, "abort")
                    yield ev
        finally:
            await self._write_back(
                request_id, [*prompt_token_ids, *generated], write_back and finished
            )

    async def generate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        use_kvstore: bool = False,
        write_back: bool = False,
    ) -> AsyncIterator[TokenEvent]:
        """Colocated: both phases here, chunked prefill in the same continuous batch."""
        self._admit("colocated")
        stages = StageCosts()
        reuse = self.kv_reuse
        generated: list[int] = []
        finished = False
        try:
            with self._track(len(token_ids)):
                if reuse is not None and (use_kvstore or write_back):
                    stages.kvstore_tokens = await self._prepare_reuse(
                        reuse, request_id, token_ids, use_kvstore, write_back
                    )
                async for ev in self._colocated_events(request_id, token_ids, params, stages):
                    generated.extend(ev.token_ids)
                    finished = ev.finish_reason not in (None, "abort")
                    yield ev
        finally:
            await self._write_back(request_id, [*token_ids, *generated], write_back and finished)

    async def _prepare_reuse(
        self,
        reuse: KVReuse,
        request_id: str,
        token_ids: Sequence[int],
        fetch: bool,
        hold_finished: bool,
    ) -> int:
        """Fetch the kvstore's prefix (holding it until scheduled) and/or ask the engine to
        keep the request's blocks when it finishes, for the write-back."""
        assert self.engine is not None
        llm = self.llm
        try:
            if fetch:
                return await reuse.fetch_prefix(request_id, token_ids, hold_finished)
            await self.engine.call(lambda: llm.hold_on_finish(request_id))
            return 0
        except BaseException:
            await self.engine.abort(request_id)  # releases every hold of the request
            raise

    async def _write_back(self, request_id: str, token_ids: list[int], publish: bool) -> None:
        """After a stream: publish its blocks to the kvstore (which then releases them), or
        just release what the engine held for it."""
        reuse = self.kv_reuse
        if reuse is None:
            return
        if publish:
            reuse.publish_later(request_id, token_ids)
        else:
            await reuse.release(request_id)

    async def _colocated_events(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        stages: StageCosts,
    ) -> AsyncIterator[TokenEvent]:
        assert self.engine is not None
        started = time.perf_counter()
        first_at: float | None = None
        async for out in self.engine.generate(request_id, token_ids, params):
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

    async def abort(self, request_id: str) -> bool:
        if self.decode_handler is None:
            return False
        return await self.decode_handler.abort(request_id)

    # ------------------------------------------------------------------ reporting
    def load_snapshot(self) -> LoadReport:
        """Cheap, lock-free reads of engine counters (approximate by design)."""
        if self.engine is None:
            return LoadReport()
        llm = self.llm
        return LoadReport(
            num_waiting=llm.num_waiting,
            num_running=llm.num_running,
            free_blocks=llm.pool.num_free_blocks,
            total_blocks=llm.num_blocks,
            tokens_in_flight=self._tokens_in_flight,
            num_reserved=self.decode_handler.num_reserved if self.decode_handler else 0,
        )

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.transport is not None:
            out.update(self.transport.counters_snapshot())
        if self.decode_handler is not None:
            out.update({f"decode_{k}": v for k, v in self.decode_handler.counters.items()})
        if self.engine is not None:
            stats = self.llm.stats()  # plain int reads; approximate while a step runs
            out["pool_free_blocks"] = float(stats["num_free_blocks"])
            out["pool_total_blocks"] = float(stats["num_blocks"])
            for name in ("prefix_hit_tokens", "prefix_hit_blocks", "num_preemptions"):
                out[f"engine_{name}"] = float(stats[name])
        if self.kv_reuse is not None:
            out.update(self.kv_reuse.counters())
        return out


def _builtin_tiny() -> str:
    from pdserve.model.tiny import ensure_builtin_tiny

    return str(ensure_builtin_tiny())
