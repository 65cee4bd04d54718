"""End to end through real processes: the router's flip controller moves a decode instance
into the prefill pool under a prefill-heavy load (long prompts, 1-2 output tokens), then a
prefill instance back into the decode pool under a decode-heavy load (short prompts, long
outputs). Every request -- including the ones in flight while a worker flipped -- returns
exactly the in-process engine's greedy tokens, with client retries off (a failure during a
flip would surface). Waits are hang guards only: load keeps coming until Status shows the
flip, at most `PHASE_GUARD_S`."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest

from .conftest import MAX_POS, VOCAB, reference_tokens, start_cluster

pytestmark = pytest.mark.integration

PHASE_GUARD_S = 30.0
# Low thresholds and a fast tick so the tiny model's load is enough; see RouterSettings.flip_*.
ROUTER_ARGS = [
    "--flip-enabled",
    "--flip-interval-s", "0.25",
    "--flip-ticks", "2",
    "--flip-cooldown-s", "1.0",
    "--flip-ratio", "2",
    "--flip-prefill-tokens", "256",
    "--flip-decode-seqs", "4",
    "--heartbeat-interval-s", "0.25",
]  # fmt: skip
# Room for every reservation of the burst on one decode; small steps make prefill the bottleneck.
WORKER_ARGS = ["--num-blocks", "1024", "--max-num-batched-tokens", "256"]


@dataclass
class Sent:
    prompt: list[int]
    max_tokens: int
    token_ids: list[int]
    finish_reason: str | None
    prefill_instance: str
    decode_instance: str
    start_s: float
    end_s: float


@pytest.fixture(scope="module")
def cluster(serving_model_dir):
    c = start_cluster(
        serving_model_dir, prefill=1, decode=2, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS
    )
    try:
        yield c
    finally:
        c.stop()


def roles(status) -> dict[str, str]:
    return {i.instance_id: i.role for i in status.instances}


async def drive(addr, make_request, concurrency: int, done) -> tuple[list[Sent], float]:
    """Keep `concurrency` requests in flight until `done(status)` holds (polled every 0.1 s);
    then each stream sends one more request (so the new layout serves some) and stops.
    Returns every request and when `done` was first seen."""
    from pdserve.client import AsyncClient

    sent: list[Sent] = []
    seen_at: list[float] = []
    give_up = asyncio.Event()

    async with AsyncClient(addr, timeout=120.0, max_retries=0) as client:

        async def one_stream() -> None:
            while not give_up.is_set():
                last = bool(seen_at)
                prompt, max_tokens = make_request()
                start = time.perf_counter()
                res = await client.generate(
                    token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                )
                usage = res.usage
                assert usage is not None
                sent.append(
                    Sent(
                        prompt=prompt,
                        max_tokens=max_tokens,
                        token_ids=res.token_ids,
                        finish_reason=res.finish_reason,
                        prefill_instance=usage.prefill_instance,
                        decode_instance=usage.decode_instance,
                        start_s=start,
                        end_s=time.perf_counter(),
                    )
                )
                if last:
                    return

        async def monitor() -> None:
            deadline = time.monotonic() + PHASE_GUARD_S
            while time.monotonic() < deadline:
                if done(await client.status()):
                    seen_at.append(time.perf_counter())
                    return
                await asyncio.sleep(0.1)
            give_up.set()

        streams = [asyncio.create_task(one_stream()) for _ in range(concurrency)]
        await monitor()
        await asyncio.wait_for(asyncio.gather(*streams), 120.0)  # hang guard
    assert seen_at, f"no flip within {PHASE_GUARD_S:g} s ({len(sent)} requests sent)"
    return sent, seen_at[0]


def check_exact(sent: list[Sent], reference_engine) -> None:
    expected = reference_tokens(reference_engine, [(s.prompt, s.max_tokens) for s in sent])
    for k, (s, ref) in enumerate(zip(sent, expected, strict=True)):
        assert s.token_ids == ref, f"request {k} ({len(s.prompt)} prompt tokens) differs"
        assert s.finish_reason == "length"


def test_flip_to_prefill_under_long_prompts_and_back_under_long_outputs(cluster, reference_engine):
    from pdserve.client import Client

    with Client(cluster.addr) as c:
        before = roles(c.status())
    assert sorted(before.values()) == ["decode", "decode", "prefill"]
    rng = random.Random(11)

    # Phase 1: prefill-heavy. Long distinct prompts, 1-2 output tokens, 24 at a time.
    def long_prompt() -> tuple[list[int], int]:
        n = rng.randint(150, MAX_POS - 8)
        return [rng.randint(2, VOCAB - 1) for _ in range(n)], rng.randint(1, 2)

    def two_prefills(status) -> bool:
        serving = [i for i in status.instances if i.state == "serving"]
        return sum(i.role == "prefill" for i in serving) == 2 and len(serving) == 3

    sent1, flipped_at = asyncio.run(drive(cluster.addr, long_prompt, 24, two_prefills))
    with Client(cluster.addr) as c:
        after1 = roles(c.status())
    moved = [iid for iid, role in after1.items() if role != before[iid]]
    assert len(moved) == 1, after1
    flipped = moved[0]
    assert before[flipped] == "decode" and after1[flipped] == "prefill"
    assert sorted(after1.values()) == ["decode", "prefill", "prefill"]  # no pool left empty
    # Requests that were running while the instance flipped, and all others, are exact.
    assert any(s.start_s < flipped_at < s.end_s for s in sent1)
    check_exact(sent1, reference_engine)
    late1 = [s for s in sent1 if s.start_s > flipped_at]
    assert late1 and all(s.decode_instance != flipped for s in late1)
    assert any(s.prefill_instance == flipped for s in late1)  # it serves its new role

    # Phase 2: decode-heavy. Short prompts, long outputs, 12 at a time on the one decode.
    def long_output() -> tuple[list[int], int]:
        n = rng.randint(4, 24)
        return [rng.randint(2, VOCAB - 1) for _ in range(n)], rng.randint(120, MAX_POS - n - 8)

    def two_decodes(status) -> bool:
        serving = [i for i in status.instances if i.state == "serving"]
        return sum(i.role == "decode" for i in serving) == 2 and len(serving) == 3

    sent2, back_at = asyncio.run(drive(cluster.addr, long_output, 12, two_decodes))
    with Client(cluster.addr) as c:
        after2 = roles(c.status())
    assert sorted(after2.values()) == ["decode", "decode", "prefill"]
    assert any(s.start_s < back_at < s.end_s for s in sent2)
    check_exact(sent2, reference_engine)
    back = next(iid for iid, role in after2.items() if role != after1[iid])
    assert after1[back] == "prefill" and after2[back] == "decode"
    late2 = [s for s in sent2 if s.start_s > back_at]
    assert late2 and all(s.prefill_instance != back for s in late2)
