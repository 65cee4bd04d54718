"""Request migration: a stream whose worker dies continues on another one.

The router knows each request's prompt and every token it has relayed, and sampling seeds
are position-derived (token i draws with seed (s, i)). So when a stream breaks after k
tokens (the worker died: UNAVAILABLE, the stream ended without a finish reason, it went
silent, or the instance stopped heartbeating), the router places a *continuation*: prompt +
the k tokens as the new prompt (the prefix cache and the kvstore make its prefill cheap),
`max_tokens` reduced by k, and `output_offset` = k so that seeded draws continue at index k.
The client's stream goes on with no error and no duplicated or missing token; greedy and
seeded outputs are those of an uninterrupted run. EOS and stop tokens are checked by the
worker on each new token as before; stop strings are applied by the router on the whole
text and do not see the seam.

Failures before the first token are the orchestrator's own retries (prefill, reserve);
migration starts once the client has seen a token. Bounded: at most `max_migrations` per
request, and a request's continuations wait at most `wait_s` in all for a decode (or
colocated) instance to exist (the supervisor may be restarting the only one): a wait on the
admission stage's `Capacity`, woken when an instance registers. A continuation is not a new
request: it keeps the request's admission turn and its length prediction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from pdserve.errors import NoInstanceHereError, PdserveError, UnavailableError
from pdserve.logging import get_logger

from ..cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Registry
from ..job import Stages
from ..scheduling.admission import Capacity

if TYPE_CHECKING:
    from ..job import Chunk, Job

log = get_logger("pdserve.router.lifecycle.migration")

# Codes of a broken stream after which another worker can continue the request.
MIGRATABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class StreamLost(UnavailableError):
    """The instance serving a stream stopped heartbeating (or was dropped) mid-stream."""


def migratable(exc: BaseException) -> bool:
    """Whether a stream that failed with `exc` may continue elsewhere: the worker is dead,
    stuck or gone (UNAVAILABLE, DEADLINE_EXCEEDED, incl. relayed worker statuses); not bad
    input, overload or cancellation."""
    return isinstance(exc, PdserveError) and exc.code in MIGRATABLE


def continuation(job: Job, emitted: Sequence[int], migration: int, kind: str = "m") -> Job:
    """The job that continues `job` on another worker after the client received `emitted`.

    Invariants (unit-tested): prompt + emitted is the new prompt; max_tokens counts only the
    tokens still owed, so prompt + max_tokens (the context needed) is unchanged; the sampler's
    output index continues at len(emitted); stop/EOS rules are the original ones.
    """
    k = len(emitted)
    left = job.params.max_tokens - k
    if k < 1 or left < 1:
        raise ValueError(f"nothing to continue: {k} of {job.params.max_tokens} tokens emitted")
    offset = job.params.output_offset + k
    return dataclasses.replace(
        job,
        request_id=f"{job.request_id}.{kind}{migration}",  # never confused with the old attempt
        token_ids=[*job.token_ids, *emitted],
        params=dataclasses.replace(job.params, max_tokens=left, output_offset=offset),
        stages=Stages(),
        prefill_instance="",
        decode_instance="",
        prefill_attempts=0,
        output_token_ids=[],
    )


def fold(into: Job, part: Job) -> None:
    """Account a continuation's work on the client's job (stages, where it ran)."""
    into.stages.add(part.stages, skip=Stages.PROMPT_ONLY)
    if part.decode_instance:
        into.decode_instance = part.decode_instance
    if part.prefill_instance:
        into.prefill_instance = part.prefill_instance


class Migrator:
    """Runs a job through `attempt` (the orchestrator's single placement) and migrates it
    when its stream breaks; see the module docstring."""

    def __init__(
        self,
        attempt: Callable[[Job], AsyncIterator[Chunk]],
        registry: Registry,
        max_migrations: int = 3,
        wait_s: float = 10.0,
        on_migration: Callable[[str], None] | None = None,
        capacity: Capacity | None = None,
    ) -> None:
        self._attempt = attempt
        self.capacity = capacity if capacity is not None else Capacity()
        self.registry = registry
        self.max_migrations = max(0, max_migrations)
        self.wait_s = wait_s
        self._on_migration = on_migration or (lambda _reason: None)

    async def run(
        self,
        job: Job,
        attempt: Callable[[Job], AsyncIterator[Chunk]] | None = None,
        received: Sequence[int] = (),
    ) -> AsyncIterator[Chunk]:
        """`job`'s chunks through `attempt` (default: the one given at construction).
        `received`: tokens the client already has (a stream resumed after its router died):
        the first attempt is the continuation after them (request id `r.r1`)."""
        attempt = attempt or self._attempt
        emitted: list[int] = list(received)
        current, migrations = job, 0
        if emitted:
            current = continuation(job, emitted, 1, kind="r")
        wait_deadline: float | None = None  # set at the first migration
        while True:
            gen = attempt(current)
            streamed = False  # this attempt yielded tokens: a failure is its stream's
            try:
                async for chunk in gen:
                    streamed = True
                    emitted.extend(chunk.token_ids)
                    if current is not job:  # (the first attempt records its own)
                        job.output_token_ids.extend(chunk.token_ids)
                    yield chunk
                    if chunk.finish_reason:
                        return
                return  # (an attempt always ends with a finish reason)
            except Exception as exc:
                if not emitted or not migratable(exc):
                    raise
                if migrations >= self.max_migrations:
                    log.warning(
                        "stream lost; no migration left",
                        request_id=job.request_id,
                        migrations=migrations,
                        error=str(exc),
                    )
                    raise
                assert isinstance(exc, PdserveError)  # (migratable)
                failure = exc
            finally:
                await gen.aclose()
                if current is not job:
                    fold(job, current)
            migrations += 1
            # The streaming instance broke (a continuation's failed prefill is the
            # orchestrator's to judge): skip it while it may be dead.
            failed = (current.decode_instance or current.prefill_instance) if streamed else ""
            if failed:
                self.registry.mark_suspect(failed)
            reason = "lost" if isinstance(failure, StreamLost) else failure.code.name.lower()
            log.warning(
                "stream migrating",
                request_id=job.request_id,
                migration=migrations,
                from_instance=failed or None,
                tokens_so_far=len(emitted),
                reason=reason,
                error=str(failure),
            )
            self._on_migration(reason)
            if wait_deadline is None:
                wait_deadline = time.monotonic() + self.wait_s
            await self._wait_for_capacity(job.request_id, wait_deadline)
            current = continuation(job, emitted, migrations)

    async def _wait_for_capacity(self, request_id: str, deadline: float) -> None:
        """Wait (until `deadline`) for a place for the continuation: a decode and a prefill
        instance, or a colocated one. The launcher may be restarting the only one."""
        if not await self.capacity.wait(deadline, ready=self._placeable):
            log.warning("stream lost: no instance to continue it on", request_id=request_id)
            raise NoInstanceHereError(
                f"the stream's worker died and no instance took it over within {self.wait_s:g} s"
            )

    def _placeable(self) -> bool:
        r = self.registry
        return bool(
            (r.candidates(ROLE_PREFILL) and r.candidates(ROLE_DECODE))
            or r.candidates(ROLE_COLOCATED)
        )
