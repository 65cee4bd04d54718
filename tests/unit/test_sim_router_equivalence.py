"""The simulator decides as the router does: the same arrival sequence through

- the router's real wiring: `RouterApp` built from the settings (its `Admission` stage, its
  `_predictor`, `_length_scheduling`, `_orchestrator`, the policy over its `DecodeDemand`),
  driven as `FrontDoor.generate` drives it (admit, predict, one admission turn, run), with
  in-process fake workers whose prefill and decode take fixed (fake) times, on an asyncio
  loop whose clock is virtual (it jumps to the next timer instead of sleeping), and
- a `SimCluster` built by `spec_from_up_flags` from the same `--router-arg` flags, whose
  step costs are the same fixed times,

gives the same decode placement, prefill placement and admission-queue order.
"""

from __future__ import annotations

import asyncio
import selectors
from types import SimpleNamespace

import pytest

from pdserve.costmodel.costs import CostModel, StepCost
from pdserve.engine.params import SamplingParams
from pdserve.kv.hashing import block_hashes
from pdserve.load import LoadReport
from pdserve.router.app import RouterApp
from pdserve.router.cluster.registry import ROLE_DECODE, ROLE_PREFILL
from pdserve.router.frontdoor.auth import ANONYMOUS
from pdserve.router.job import Job
from pdserve.sim.cluster import SimCluster
from pdserve.sim.router_side import router_settings
from pdserve.sim.run import spec_from_up_flags
from pdserve.v1 import common_pb2, worker_pb2
from pdserve.workload.requests import BenchRequest
from tests.unit.test_router_placement import ChunkCall, UnaryCall

PREFILL_S = 1 / 64  # every prefill takes this long (binary fractions: exact sums)
TOKEN_S = 1 / 128  # every decode token
NUM_BLOCKS = 400
BLOCK = 16


class _VirtualSelector(selectors.DefaultSelector):
    """Never sleeps: a select that would wait advances the loop's virtual clock instead."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout is None or timeout <= 0:
            return ready
        self._clock[0] += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._vt = [0.0]
        super().__init__(_VirtualSelector(self._vt))

    def time(self) -> float:
        return self._vt[0]


class TimedWorker:
    """A worker whose calls take fixed virtual times; logs what the router asked of it."""

    def __init__(self, iid: str, log: list[tuple[str, str, str]]) -> None:
        self.iid, self.log = iid, log

    def Prefill(self, req, timeout=None, metadata=None):
        self.log.append(("prefill", req.request_id, self.iid))

        async def go():
            await asyncio.sleep(PREFILL_S)
            return worker_pb2.PrefillResponse(first_token_id=11)

        return UnaryCall(go())

    def Decode(self, req, metadata=None):
        """One stream reserves and decodes: the ticket first, then the tokens after token 0."""
        self.log.append(("decode", req.request_id, self.iid))
        n = req.sampling.max_tokens

        async def go():
            yield worker_pb2.TokenChunk(
                ticket=worker_pb2.Ticket(ticket_id=1, decode_instance_id=self.iid)
            )
            for i in range(1, n):
                await asyncio.sleep(TOKEN_S)
                last = i == n - 1
                yield worker_pb2.TokenChunk(
                    token_ids=[11], finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0
                )

        return ChunkCall(go())

    async def Abort(self, req, timeout=None, metadata=None):
        return worker_pb2.AbortResponse(found=True)


class Workers:
    def __init__(self) -> None:
        self.by_address: dict[str, TimedWorker] = {}

    def stub(self, address: str) -> TimedWorker:
        return self.by_address[address]

    def open_decode(self, address: str, req) -> ChunkCall:
        return self.by_address[address].Decode(req)

    async def close(self) -> None:
        return None


def _hasher(token_ids, block_size):
    return block_hashes(token_ids, block_size, "sim-router")  # as SimCluster._hasher


def workload() -> list[BenchRequest]:
    """Requests every 4 prefill times, prompts and lengths spread out."""
    lengths = [180, 40, 260, 90, 20, 150, 300, 60, 120, 30, 210, 75, 45, 100]
    reqs = []
    for i, n in enumerate(lengths):
        prompt = [10 + (i * 37 + k * 11) % 900 for k in range(40 + (i * 53) % 400)]
        reqs.append(BenchRequest(i, prompt, n, arrival_s=i * 4 * PREFILL_S))
    return reqs


def router_decisions(flags: list[str], reqs: list[BenchRequest]) -> list[tuple[str, str, str]]:
    settings = router_settings(flags)
    app = RouterApp(settings)  # the router's own wiring of policy, demand, predictor, queue
    log: list[tuple[str, str, str]] = []
    workers = Workers()
    load = LoadReport(free_blocks=NUM_BLOCKS, total_blocks=NUM_BLOCKS)
    for role, name, n in ((ROLE_PREFILL, "prefill", 2), (ROLE_DECODE, "decode", 2)):
        for k in range(n):
            iid = f"{name}-{k}"
            app.registry.register(iid, f"{iid}:1", role, "sim", BLOCK, load)
            workers.by_address[f"{iid}:1"] = TimedWorker(iid, log)
    loop = VirtualLoop()
    try:

        async def main() -> None:
            app.admission.queue._clock = loop.time  # the router's queue on the virtual clock
            app.workers = workers  # type: ignore[assignment]
            app._prefix_hashes = _hasher  # type: ignore[method-assign]
            length = app._length_scheduling(app._predictor())
            orch = app._orchestrator(SimpleNamespace(eos_token_ids=[]), length)  # type: ignore[arg-type]

            async def one(r: BenchRequest) -> None:
                await asyncio.sleep(r.arrival_s - loop.time())
                job = Job(
                    request_id=f"r{r.index}",
                    token_ids=list(r.prompt_ids),
                    params=SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                    oracle_tokens=r.max_tokens,
                )
                # FrontDoor.generate: admit, predict, one turn, run
                async with app.admission.admit(ANONYMOUS) as admission:
                    pred = await orch.predict(job)
                    await admission.turn(pred.predicted_tokens)
                    async for _ in orch.run(job, pred):
                        pass

            await asyncio.gather(*(one(r) for r in reqs))
            await orch.close()

        loop.run_until_complete(main())
    finally:
        for task in asyncio.all_tasks(loop):  # watchdogs of finished streams
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    return log


def sim_decisions(flags: list[str], reqs: list[BenchRequest]) -> list[tuple[str, str, str]]:
    up = ["--mode", "disagg", "--prefill", "2", "--decode", "2",
          "--worker-arg", f"--num-blocks={NUM_BLOCKS} --max-num-seqs=256",
          *(f"--router-arg={f}" for f in flags)]  # fmt: skip
    costs = {
        "prefill": CostModel(step=StepCost(base_s=PREFILL_S)),
        "decode": CostModel(step=StepCost(base_s=TOKEN_S)),
    }
    spec = spec_from_up_flags(up, costs, max_model_len=4096, block_size=BLOCK)
    spec.heartbeat_interval_s = 1e9  # loads as registered (the router side gets none either)
    cluster = SimCluster(spec)
    log: list[tuple[str, str, str]] = []
    orig = cluster._pick

    def pick(role, route, decode, exclude=()):
        inst = orig(role, route, decode, exclude)
        log.append(
            ("decode" if role == ROLE_DECODE else "prefill", route.request_id, inst.instance_id)
        )
        return inst

    cluster._pick = pick  # type: ignore[method-assign]
    records = cluster.run(reqs)
    assert all(r.error is None for r in records)
    return log


ARMS = {
    "sjf queue, predicted placement, headroom (online predictor, no text model)": [
        "--queue-max-running-per-decode=2", "--queue-order=sjf",
        "--queue-aging-tokens-per-s=0", "--decode-placement=predicted",
        "--reserve-max-tokens=64", "--predictor-path=none", "--no-predictor-use-max-tokens",
    ],
    "sjf queue with the oracle": [
        "--queue-max-running-per-decode=1", "--predictor-oracle",
        "--queue-aging-tokens-per-s=0", "--no-predictor-use-max-tokens",
        "--predictor-path=none", "--decode-placement=predicted",
    ],
    "fcfs queue, count placement": [
        "--queue-max-running-per-decode=1", "--queue-order=fcfs", "--predictor-path=none",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", list(ARMS))
def test_simulator_decides_as_the_router(name):
    flags = ARMS[name]
    reqs = workload()
    real = router_decisions(flags, reqs)
    sim = sim_decisions(flags, workload())
    assert len(real) == 2 * len(reqs)
    decode_real = [(r, i) for k, r, i in real if k == "decode"]
    decode_sim = [(r, i) for k, r, i in sim if k == "decode"]
    assert (
        decode_sim == decode_real
    )  # queue order (the order of Decode streams opened) and placement
    assert [x for x in sim if x[0] == "prefill"] == [x for x in real if x[0] == "prefill"]


def test_the_queue_reorders_and_placement_reads_predictions():
    """The arms above are not vacuous: SJF lets requests in out of arrival order, and the
    predicted-footprint placement differs from the count placement."""
    reqs = workload()
    sjf = [r for k, r, _ in sim_decisions(ARMS["sjf queue with the oracle"], reqs) if k == "decode"]
    fcfs = [r for k, r, _ in sim_decisions(ARMS["fcfs queue, count placement"], reqs)
            if k == "decode"]  # fmt: skip
    assert fcfs == [f"r{i}" for i in range(len(reqs))]
    assert sjf != fcfs
    flags = next(iter(ARMS.values()))
    pred = sim_decisions(flags, reqs)
    count = sim_decisions([f for f in flags if "placement" not in f], reqs)
    assert pred != count
