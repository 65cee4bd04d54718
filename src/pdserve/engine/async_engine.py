"""AsyncEngine: the LLMEngine on its own thread, with an asyncio front of named commands.

The engine thread loops: run queued commands, then one `step()` if any request is unfinished;
with nothing to do it sleeps on a condition (never spins). Every operation is a command from
`engine.commands`, queued by a named method here and executed by `_execute`, the one dispatch
place; the engine is only ever touched by its thread. Results cross back to the event loop
with `loop.call_soon_threadsafe`.

Cancellation is safe by construction: a command is queued synchronously when its method is
called, so it runs even if the caller is cancelled while waiting; what it allocates is
registered under its request id on the engine thread, and a cancelled `reserve` queues a
`Release` of that id (idempotent) before re-raising. A stream whose consumer leaves early
queues an `Abort` without awaiting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdserve.engine.commands import (
    Abort,
    AddRequest,
    AdmitPrefilled,
    CachedPrefixLength,
    Command,
    EngineInspection,
    HoldOnFinish,
    ImportAndHold,
    Inspect,
    ReadForPublish,
    Release,
    Reserve,
)
from pdserve.engine.engine import KVSink, LLMEngine, step_shape
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.params import SamplingParams
from pdserve.engine.step_log import StepLog
from pdserve.errors import InvalidRequestError, UnavailableError
from pdserve.kv.spec import KVSpec

_Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]
_EWMA_ALPHA = 0.1


@dataclasses.dataclass(frozen=True)
class _Queued:
    cmd: Command
    loop: asyncio.AbstractEventLoop | None
    fut: asyncio.Future | None  # None: fire and forget
    stream: _Stream | None = None  # AddRequest / AdmitPrefilled: where outputs go


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, step_log: StepLog | None = None) -> None:
        self._llm = engine
        self._step_log = step_log  # engine thread only
        # immutable facts about the engine, safe to read from any thread
        self.spec: KVSpec = engine.spec
        self.dtype: str = engine.dtype  # compute dtype served (spec.dtype is the KV dtype)
        self.kv_fingerprint: str = engine.kv_fingerprint
        self.model_fingerprint: str = engine.loaded.fingerprint
        self.num_blocks: int = engine.num_blocks
        self.num_window_blocks: int = engine.num_window_blocks  # 0 without a window pool
        self.vocab_size: int = engine.vocab_size
        self.max_model_len: int = engine.max_model_len
        self.kernels: Any = engine.kernels  # pdserve.model.kernels.KernelSelection (None: emulated)
        self.step_ms_ewma = 0.0  # written by the engine thread after each step
        # every step so far and their seconds (engine thread; read as counters: the mean step
        # over any window is the two counters' differences)
        self.steps_total = 0
        self.step_seconds_total = 0.0
        self.accounting = EngineInspection(0, 0, self.num_blocks, self.num_blocks, 0, 0, 0, 0)
        self._cond = threading.Condition()
        self._commands: deque[_Queued] = deque()
        self._streams: dict[str, _Stream] = {}  # engine-thread only
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- named commands (asyncio side) ------------------------------------------------
    async def reserve(self, request_id: str, num_tokens: int, num_kv_tokens: int = 0) -> list[int]:
        """Reserve blocks for `num_tokens` tokens of `request_id`, whose first `num_kv_tokens`
        tokens' KV arrives from elsewhere (LLMEngine.reserve). If the caller is cancelled
        while waiting, the reservation is released (it may already have been made)."""
        try:
            return await self._submit(Reserve(request_id, num_tokens, num_kv_tokens))
        except asyncio.CancelledError:
            self._post(Release(request_id))
            raise

    async def release(self, request_id: str) -> int:
        """Free `request_id`'s reservation and holds. Idempotent; blocks released."""
        return await self._submit(Release(request_id))

    def release_nowait(self, request_id: str) -> None:
        """`release` without waiting (usable in finally blocks and callbacks)."""
        self._post(Release(request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop `request_id` and free all it owns. Idempotent; True if it was live."""
        return await self._submit(Abort(request_id))

    def abort_nowait(self, request_id: str) -> None:
        self._post(Abort(request_id))

    async def hold_on_finish(self, request_id: str) -> None:
        await self._submit(HoldOnFinish(request_id))

    async def cached_prefix_length(self, hashes: Sequence[bytes]) -> int:
        return await self._submit(CachedPrefixLength(list(hashes)))

    async def import_and_hold(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        fetched: Sequence[bytes],
        data: Any,
        hold_on_finish: bool = False,
        window_from: int = 0,
    ) -> None:
        """Import `data` (blocks of the chain `fetched`) and hold the cached prefix of `hashes`
        for `request_id` until it is scheduled (or released / aborted). `window_from`: the
        sliding layers of blocks before it were not fetched (a layered kvstore hit)."""
        cmd = ImportAndHold(
            request_id, list(hashes), list(fetched), data, hold_on_finish, window_from
        )
        await self._submit(cmd)

    async def read_for_publish(self, hashes: Sequence[bytes], skip: int) -> Any:
        return await self._submit(ReadForPublish(list(hashes), skip))

    async def inspect(self) -> EngineInspection:
        return await self._submit(Inspect())

    def empty_kv(self, shape: Sequence[int]) -> Any:
        """An uninitialised CPU buffer of the KV dtype (torch tensor or numpy array, as the
        engine's runner holds its KV); touches no engine state, so any thread may call it."""
        return self._llm.empty_kv(shape)

    def compute_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Pure function of the tokens and the kv_fingerprint: runs on the caller's thread."""
        return self._llm.kv.compute_block_hashes(token_ids)

    def load(self) -> dict[str, int]:
        """Lock-free reads of engine counters (approximate while a step runs). `accounting`
        is the block accounting the engine thread published after its last commands/step."""
        llm = self._llm
        st = llm.kv.stats
        return {
            "num_running": llm.num_running,
            "num_waiting": llm.num_waiting,
            "num_free_blocks": llm.kv.num_free_blocks,
            "num_free_window_blocks": llm.kv.num_free_window_blocks,
            "prefix_hit_tokens": st.hit_tokens,
            "prefix_hit_blocks": st.hit_blocks,
            "num_preemptions": llm.scheduler.num_preemptions,
        }

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        kv_sink: KVSink | None = None,
        hold_on_finish: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the loop early aborts the request."""
        cmd = AddRequest(
            request_id, list(prompt_token_ids), params or SamplingParams(),
            prefill_only, kv_sink, hold_on_finish,
        )  # fmt: skip
        return self._stream(request_id, cmd)

    async def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        kv: Any,
        hold_on_finish: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Decode side: write `kv` ([L, n, ...]) into the request's reserved blocks and admit
        it, in one command; returns (once admitted) the stream of its tokens 1..; raises if
        the admission failed (its reservation is then already freed)."""
        cmd = AdmitPrefilled(
            request_id, list(prompt_token_ids), first_token, params, kv, hold_on_finish
        )
        return await self._open(request_id, cmd)

    async def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    # ---- queueing ---------------------------------------------------------------------
    def _submit(self, cmd: Command, stream: _Stream | None = None) -> asyncio.Future:
        """Queue `cmd` now (synchronously) and return the future of its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._enqueue(_Queued(cmd, loop, fut, stream))
        return fut

    def _post(self, cmd: Command) -> None:
        """Queue `cmd` without waiting for it (silently dropped after shutdown)."""
        try:
            self._enqueue(_Queued(cmd, None, None))
        except UnavailableError:
            pass

    def _enqueue(self, item: _Queued) -> None:
        with self._cond:
            if self._stopped:
                raise UnavailableError("engine is shut down")
            self._commands.append(item)
            self._cond.notify()

    async def _open(self, request_id: str, cmd: Command) -> AsyncIterator[RequestOutput]:
        """Run a stream-starting command; return its outputs once it ran."""
        queue: asyncio.Queue = asyncio.Queue()
        try:
            await self._submit(cmd, stream=(asyncio.get_running_loop(), queue))
        except BaseException:  # failed, or the caller was cancelled: abort (idempotent)
            self._post(Abort(request_id))
            raise
        return self._outputs(request_id, queue)

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The stream's outputs in order. After the first one, outputs already queued when
        the consumer comes back (it fell behind the engine: a slow client, a busy loop) are
        merged into one, so a stream that lags sends fewer, larger messages instead of
        falling further behind."""
        finished, first = False, True
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                pending: BaseException | None = None
                if not first:
                    item, pending = _merge_queued(item, queue)
                first = False
                finished = item.finished or pending is not None
                yield item
                if pending is not None:
                    raise pending
                if finished:
                    return
        finally:
            if not finished:  # cancelled or closed early: abort (idempotent, no await)
                self._post(Abort(request_id))

    async def _stream(self, request_id: str, cmd: Command) -> AsyncIterator[RequestOutput]:
        outputs = await self._open(request_id, cmd)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    # ---- engine thread ----------------------------------------------------------------
    def _execute(self, cmd: Command, stream: _Stream | None) -> Any:
        """The one place where commands touch the engine (engine thread only)."""
        llm = self._llm
        match cmd:
            case Reserve(request_id, num_tokens, num_kv_tokens):
                return llm.reserve(request_id, num_tokens, num_kv_tokens)
            case Release(request_id):
                return llm.release(request_id)
            case Abort(request_id):
                live = llm.abort_request(request_id)
                if request_id in self._streams:
                    self._emit(RequestOutput(request_id, [], True, "abort"))
                return live
            case HoldOnFinish(request_id):
                llm.hold_on_finish(request_id)
                return None
            case CachedPrefixLength(hashes):
                return len(llm.cached_prefix(hashes))
            case ImportAndHold(request_id, hashes, fetched, data, hold_on_finish, window_from):
                if fetched:
                    llm.import_cached_blocks(fetched, data, window_from)
                llm.hold_prefix(request_id, hashes)
                if hold_on_finish:
                    llm.hold_on_finish(request_id)
                return None
            case ReadForPublish(hashes, skip):
                return llm.read_cached(hashes, skip)
            case Inspect():
                llm.check_integrity()
                return self._accounting()
            case AddRequest() | AdmitPrefilled():
                assert stream is not None
                self._start_stream(cmd, stream)
                return None
        raise TypeError(f"unknown engine command {cmd!r}")

    def _accounting(self) -> EngineInspection:
        llm, kv = self._llm, self._llm.kv
        return EngineInspection(
            llm.num_running, llm.num_waiting, llm.num_blocks, kv.num_free_blocks,
            kv.num_reservations, kv.num_reserved_blocks, kv.num_held_blocks, len(self._streams),
        )  # fmt: skip

    def _start_stream(self, cmd: AddRequest | AdmitPrefilled, stream: _Stream) -> None:
        llm = self._llm
        rid = cmd.request_id
        if rid in self._streams:
            raise InvalidRequestError("request_id", f"{rid!r} is already streaming")
        self._streams[rid] = stream
        try:
            if isinstance(cmd, AddRequest):
                if cmd.hold_on_finish:
                    llm.hold_on_finish(rid)
                llm.add_request(
                    rid, cmd.prompt_token_ids, cmd.params,
                    prefill_only=cmd.prefill_only, kv_sink=cmd.kv_sink,
                )  # fmt: skip
                return
            for layer in range(self.spec.num_layers):
                llm.write_kv(rid, layer, cmd.kv[layer], len(cmd.prompt_token_ids))
            if cmd.hold_on_finish:
                llm.hold_on_finish(rid)
            first = llm.add_prefilled_request(
                rid, cmd.prompt_token_ids, cmd.first_token, cmd.params
            )
        except BaseException:
            del self._streams[rid]
            llm.release(rid)  # a failed admission leaves no reservation or hold behind
            raise
        if first is not None:
            self._emit(first)

    def _emit(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, queue = stream
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _emit_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs cross to each event loop in ONE callback: they land in their
        queues in the same loop iteration, so whatever reads them next (a worker's Streams
        writer) sees the whole step at once instead of a callback's worth at a time (the
        thread hand-off of each separate callback lets the loop run between them)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop, queue = stream
            by_loop.setdefault(loop, []).append((queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, (loop, queue) in list(self._streams.items()):
            self._llm.abort_request(rid)
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        self._streams.clear()

    def _run_commands(self, items: list[_Queued]) -> None:
        for item in items:
            try:
                result, exc = self._execute(item.cmd, item.stream), None
            except BaseException as e:
                result, exc = None, e
            if item.fut is not None and item.loop is not None:
                item.loop.call_soon_threadsafe(_resolve, item.fut, result, exc)

    def _run(self) -> None:
        llm = self._llm
        while True:
            with self._cond:
                while (
                    not self._commands and not self._stopped and not llm.has_unfinished_requests()
                ):
                    self._cond.wait()
                if self._stopped:
                    break
                items = list(self._commands)
                self._commands.clear()
            self._run_commands(items)
            self.accounting = self._accounting()
            if llm.has_unfinished_requests():
                cpu_started = time.thread_time() if self._step_log is not None else 0.0
                started = time.perf_counter()
                try:
                    outputs = llm.step()
                except Exception as e:  # a failed step fails every live stream, not the thread
                    self._fail_all(e)
                    continue
                step_ms = (time.perf_counter() - started) * 1e3
                if self._step_log is not None and llm.last_plan is not None:
                    shape = step_shape(llm.last_plan, llm.last_pushes)
                    cpu_s = time.thread_time() - cpu_started
                    self._step_log.record(started, step_ms / 1e3, cpu_s, shape)
                self.steps_total += 1
                self.step_seconds_total += step_ms / 1e3
                ewma = self.step_ms_ewma
                self.step_ms_ewma = step_ms if ewma == 0 else ewma + _EWMA_ALPHA * (step_ms - ewma)
                self._emit_step(outputs)
                self.accounting = self._accounting()
        if self._step_log is not None:
            self._step_log.close()
        # shutting down: fail pending commands and streams
        err = UnavailableError("engine is shut down")
        with self._cond:
            pending = list(self._commands)
            self._commands.clear()
        for item in pending:
            if item.fut is not None and item.loop is not None:
                item.loop.call_soon_threadsafe(_resolve, item.fut, None, err)
        self._fail_all(err)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _merge_queued(
    out: RequestOutput, queue: asyncio.Queue
) -> tuple[RequestOutput, BaseException | None]:
    """`out` followed by every output already in `queue`, as one output (the tokens in order,
    the rest from the last one); stops at the stream's finish or at a queued error, which is
    returned for the caller to raise after yielding the merged output."""
    tokens: list[int] | None = None
    while not out.finished and not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, BaseException):
            return out, nxt
        if tokens is None:
            tokens = list(out.new_token_ids)
        tokens.extend(nxt.new_token_ids)
        out = dataclasses.replace(nxt, new_token_ids=tokens, extras={**out.extras, **nxt.extras})
    return out, None
