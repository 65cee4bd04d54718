"""The simulated cluster: router + workers (+ kvstore) in simulated time.

Real decision code, called as the services call it:
- placement: a `router.scheduling.policies.PlacementPolicy` (pick_decode, pick_prefill,
  on_routed) over `Registry.candidates(role)`, with the router's in-flight counters (`Registry.charge`)
  and heartbeat loads (`Registry.heartbeat` every `heartbeat_interval_s` with the instance's
  `LoadReport`), exactly the inputs the orchestrator gives them;
- admission and length-aware scheduling (`ClusterSpec.router`, a `RouterSettings`): the
  router's own `Admission` stage (the router-wide running limit, its bounded `OverloadQueue`,
  SJF or FCFS, with the queue timeout; per-key limits are the open API's: none),
  `LengthScheduling` (predict with the configured predictor, route: KV headroom, placed /
  progress / left / done), `DecodeDemand` and predicted-footprint placement, built as
  `RouterApp` builds them (`sim.router_side`); when no decision reads a prediction no
  predictor runs, and when no running limit is set no request passes the queue;
- role flips: `FlipPolicy.decide` every `flip_interval_s` on
  `router.flip.controller.snapshot(registry, demand)`;
- batching, chunking, prefix caching, preemption: the engine `Scheduler` and `BlockPool`
  (`pdserve.sim.instance.SimInstance`);
- kvstore eviction: the kvstore's `BlockStore`, sized in blocks (one arena byte per block);
- the front door's prompt limits (`InputLimits` from `--max-prompt-tokens/-chars`).

The request path mirrors the front door and `router.lifecycle.orchestrator`: predict, take an
admission turn, then disaggregated = pick decode, reserve prompt+1 (+ headroom) blocks there
(another decode when full; all full: wait for capacity as `admission.Capacity` does, i.e.
until the registry changes (a heartbeat, a request leaving an instance) or `recheck_s`
passes, up to `kv_queue_timeout_s`), pick prefill, [kvstore fetch], prefill, KV push, decode.
Colocated = pick an instance, [kvstore fetch], prefill + decode there.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.costmodel.costs import CostModel
from pdserve.engine.params import SamplingParams
from pdserve.engine.sequence import Sequence as Seq
from pdserve.errors import OverloadedError
from pdserve.kv.hashing import block_hashes
from pdserve.kvstore.store import BlockStore
from pdserve.router.app import predictions_needed
from pdserve.router.cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Registry
from pdserve.router.flip.controller import snapshot
from pdserve.router.flip.policy import FlipPolicy, FlipThresholds
from pdserve.router.frontdoor.auth import ANONYMOUS
from pdserve.router.frontdoor.input_limits import InputLimits
from pdserve.router.job import Job
from pdserve.router.scheduling.admission import Admission
from pdserve.router.scheduling.demand import DecodeDemand
from pdserve.router.scheduling.factory import make_policy
from pdserve.router.scheduling.length import LengthScheduling, Prediction
from pdserve.router.scheduling.policies import PlacementPolicy, RouteRequest
from pdserve.router.scheduling.predictor import EwmaPredictor, OutputLengthPredictor
from pdserve.router.settings import RouterSettings
from pdserve.sim import router_side
from pdserve.sim.events import EventLoop
from pdserve.sim.instance import SAMPLED_TOKEN, InstanceConfig, SimInstance, SimSeq
from pdserve.workload.metrics import RequestRecord
from pdserve.workload.requests import BenchRequest

ROLE_BY_NAME = {"prefill": ROLE_PREFILL, "decode": ROLE_DECODE, "colocated": ROLE_COLOCATED}


@dataclass
class PoolSpec:
    role: str  # prefill | decode | colocated
    count: int
    costs: CostModel
    config: InstanceConfig = field(default_factory=InstanceConfig)


@dataclass
class ClusterSpec:
    pools: list[PoolSpec]
    policy: str = "prefix_aware"
    session_affinity: bool = True
    kvstore_capacity_bytes: int | None = None  # None: no kvstore
    heartbeat_interval_s: float = 1.0
    kv_queue_timeout_s: float = 30.0
    # the router's length-aware settings (predictor, queue, headroom, decode placement);
    # None: RouterSettings' defaults
    router: RouterSettings | None = None
    flip: FlipThresholds | None = None  # None: no flip controller
    flip_interval_s: float = 2.0
    flip_switch_s: float = 0.05  # SetRole after the instance drained
    # Each request's path overhead (`router_overhead_s`) x U(1 - j, 1 + j), seeded: a real
    # request path varies (the router and its hops on shared cores), and a finish a fraction
    # of a millisecond earlier or later can send the next prompt elsewhere; 0 = constant
    path_jitter: float = 0.0
    path_seed: int = 0
    # each instance's engine seconds (`SimInstance.engine_s`), for comparing with a real
    # worker's step counters
    track_engine: bool = False

    def describe(self) -> str:
        return " + ".join(f"{p.count}x{p.role}" for p in self.pools)


@dataclass
class _Req:
    req: BenchRequest
    rec: RequestRecord
    route: RouteRequest | None = None
    decode: SimInstance | None = None
    prefill: SimInstance | None = None
    worker_arrival: float = 0.0
    first_token_at: float = 0.0
    kvstore_tokens: int = 0
    queue_deadline: float = 0.0  # of the capacity wait (kv_queue_timeout_s)
    reserve_started: float = 0.0  # when placement began reserving on a decode
    job: Job | None = None
    pred: Prediction | None = None  # the length prediction (None: nothing reads it)
    admission: Any = None  # the admission context (`Admission.admit`) while it holds a pass
    admit_error: str = ""


class SimCluster:
    def __init__(
        self,
        spec: ClusterSpec,
        policy: PlacementPolicy | None = None,
        predictor: OutputLengthPredictor | None = None,
    ) -> None:
        self.spec = spec
        self.loop = EventLoop()
        self._path_rng = random.Random(spec.path_seed)
        self.registry = Registry(heartbeat_timeout_s=1e18, clock=self.loop.clock)
        rs = spec.router if spec.router is not None else router_side.router_settings()
        self.settings = rs
        self.demand = DecodeDemand()
        self.policy = policy or make_policy(
            spec.policy,
            spec.session_affinity,
            rs.placement.decode_placement,
            self.demand,
            rs.placement.length_routing_tokens,
        )
        if hasattr(self.policy, "_clock"):  # session TTLs run on simulated time
            self.policy._clock = self.loop.clock  # type: ignore[attr-defined]
        # The router's length scheduling when some decision reads a prediction (or a
        # predictor is given explicitly, e.g. by a test) or the admission queue orders by it;
        # the admission stage when a running limit can make requests wait.
        # (length routing reads predictions on decodes of mixed memory: the spec's decode
        # pools; the router asks its registry per request, so a flip can change it there)
        decode_kv = {p.config.num_blocks * p.config.block_size
                     for p in spec.pools if p.role == "decode"}  # fmt: skip
        needed = predictor is not None or predictions_needed(rs, len(decode_kv) > 1)
        limited = router_side.admission_limited(rs)
        self.length: LengthScheduling | None = None
        self.admission: Admission | None = None
        self.aio: router_side.AsyncDriver | None = None
        if needed or limited:
            # (an FCFS queue reads no prediction: predict() then returns max_tokens unrun)
            pred = predictor or (router_side.build_predictor(rs) if needed else EwmaPredictor())
            self.length = router_side.build_length(rs, pred, self.demand)
            self.length.needed = needed
            self.aio = router_side.AsyncDriver(self.loop.clock)
        if limited:
            self.admission = router_side.build_admission(rs, self._serving, self.loop.clock)
        self.recheck_s = router_side.admission_config(rs).recheck_s
        # the front door's input limits (--max-prompt-tokens, --max-prompt-chars)
        max_len = max(p.config.max_model_len for p in spec.pools)
        self.input_limits = InputLimits.from_settings(rs.limits, max_len)
        self._kv_waiting: dict[str, int] = {}  # capacity waits: request id -> wait number
        self._kv_waits = 0
        self.predictor = self.length.predictor if self.length is not None else None
        self.flip_policy = FlipPolicy(spec.flip) if spec.flip else None
        self.admitted: list[str] = []  # request ids in the order admission gave them turns
        self.flips: list[dict[str, Any]] = []
        self.instances: dict[str, SimInstance] = {}
        self._stepping = 0  # instances with a step in flight
        per_role: dict[str, int] = {}
        for pool in spec.pools:
            for _ in range(pool.count):
                k = per_role[pool.role] = per_role.get(pool.role, -1) + 1  # pools of one role
                iid = f"{pool.role}-{k}"
                inst = SimInstance(iid, ROLE_BY_NAME[pool.role], pool.costs, pool.config)
                inst.track_engine = spec.track_engine
                self.instances[iid] = inst
                self.registry.register(
                    iid, f"sim:{iid}", inst.role, "sim", pool.config.block_size, inst.load()
                )
        # a request's path before placement (the instances are fixed from here on): a
        # disaggregated request's Reserve round trip comes after it (`_try_reserve`), and a
        # 1-token request's path has none
        costs = [i.costs for i in self.instances.values()]
        self._path_before_placement_s = max(
            0.0,
            max((c.router_overhead_s for c in costs), default=0.0)
            - max((c.reserve_s for c in costs), default=0.0),
        )
        # instances that slow each other while both step (a CPU host): their steps are
        # timed by the work left and the rate they run at (`_retime`), not a fixed length
        self._shared_host = any(
            i.costs.neighbour_busy_factor != 1.0 or i.costs.neighbour_points
            for i in self.instances.values()
        )
        self.store: BlockStore | None = None
        self._store_block_bytes = 0
        # a layered model with a window pool stores blocks as parts (kvstore/window.py):
        # (main part bytes, window part bytes, window blocks: kv.store_parts.window_blocks)
        self._parts: tuple[int, int, int] | None = None
        if spec.kvstore_capacity_bytes is not None:
            first = spec.pools[0]
            bs = first.config.block_size
            c = first.costs
            self._store_block_bytes = max(1, c.kv_bytes_per_token * bs)
            if c.kv_window and first.config.window is not None:
                win_b = c.kv_window_bytes_per_token * bs
                self._parts = (self._store_block_bytes - win_b, win_b, -(-c.kv_window // bs) + 1)
                self._store_block_bytes = self._parts[0]
                self.store = BlockStore(spec.kvstore_capacity_bytes)  # two part sizes, in bytes
            else:
                blocks = max(1, spec.kvstore_capacity_bytes // self._store_block_bytes)
                self.store = BlockStore(blocks, block_bytes=1)
        self._reqs: dict[str, _Req] = {}
        self._pending = 0
        self.misses = 0  # finished requests that missed `stop_slo` (early stop)
        self.stop_slo: tuple[float, float] | None = None  # (ttft_s, tpot_s)
        self._stop_ms = (0.0, 0.0)
        self.stop_after_misses: int | None = None
        self.records: list[RequestRecord] = []
        self.placements: dict[str, int] = {iid: 0 for iid in self.instances}  # picks per instance
        self.registry.on_change(self._capacity_changed)  # as RouterApp wires Capacity

    # ------------------------------------------------------------------ driver
    def stop_early(
        self,
        ttft_s: float,
        tpot_s: float,
        max_misses: int,
        limits_ms: tuple[float, float] | None = None,
    ) -> None:
        """Stop as soon as more than `max_misses` finished requests missed the SLOs: the
        run's attainment is then known to be below the target (the unfinished requests
        count as failures, so the reported attainment is a lower bound). A miss is judged
        as `workload.goodput.meets` judges it (value in ms > limit in ms; `limits_ms`: the
        SLOs exactly as given), so a run that stops early is one that fails."""
        self.stop_slo = (ttft_s, tpot_s)
        self._stop_ms = limits_ms or (ttft_s * 1000.0, tpot_s * 1000.0)
        self.stop_after_misses = max_misses

    def _stopped(self) -> bool:
        return self._pending == 0 or (
            self.stop_after_misses is not None and self.misses > self.stop_after_misses
        )

    def run(
        self, requests: Sequence[BenchRequest], until_s: float | None = None
    ) -> list[RequestRecord]:
        for req in requests:
            self._pending += 1
            self.loop.at(req.arrival_s, self._arrive_cb(req))
        self.loop.at(0.0, self._heartbeat)
        if self.flip_policy is not None:
            self.loop.at(self.spec.flip_interval_s, self._flip_tick)
        try:
            self.loop.run(until=until_s, stop=self._stopped)
        finally:
            if self.aio is not None:
                self.aio.close()
        for req in requests:  # not arrived yet when the run stopped early
            if f"r{req.index}" not in self._reqs:
                rec = RequestRecord(
                    req.index, req.arrival_s, req.arrival_s, len(req.prompt_ids), req.max_tokens
                )
                self._reqs[f"r{req.index}"] = _Req(req, rec)
        for st in self._reqs.values():  # anything left at `until_s` counts as failed
            if st.rec.finish_s is None and st.rec.error is None:
                st.rec.error = "simulation ended"
        self.records = sorted((s.rec for s in self._reqs.values()), key=lambda r: r.index)
        return self.records

    def _arrive_cb(self, req: BenchRequest) -> Callable[[], None]:
        return lambda: self._arrive(req)

    def _heartbeat(self) -> None:
        for inst in self.instances.values():
            self.registry.heartbeat(inst.instance_id, inst.role, "", inst.load())
        if self._pending:
            self.loop.after(self.spec.heartbeat_interval_s, self._heartbeat)

    def _hasher(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        return block_hashes(token_ids, block_size, "sim-router")  # as router.app._hasher

    def _serving(self) -> int:
        """`RouterApp._serving`: decode (or colocated) instances serving now."""
        serving = self.registry.candidates(ROLE_DECODE) or self.registry.candidates(ROLE_COLOCATED)
        return len(serving)

    def _block_size(self) -> int:
        """`Orchestrator._predictor_block_size`: the cluster's block size."""
        for inst in self.registry.instances():
            if inst.block_size > 0:
                return inst.block_size
        return 0

    # ------------------------------------------------------------------ arrival
    def _arrive(self, req: BenchRequest) -> None:
        rid = f"r{req.index}"
        rec = RequestRecord(
            req.index, req.arrival_s, req.arrival_s, len(req.prompt_ids), req.max_tokens
        )
        rec.session_id = req.session_id
        st = _Req(req, rec)
        self._reqs[rid] = st
        refused = self._refused(req)
        if refused:
            self._fail(rid, f"INVALID_ARGUMENT: prompt: {refused}")
            return
        too_big = self._over_capacity(req)
        if too_big:  # the worker's refusal (`LLMEngine.validate`); it would wait forever here
            self._fail(rid, f"INVALID_ARGUMENT: max_tokens: {too_big}")
            return
        overhead = self._path_before_placement_s
        if self.spec.path_jitter:
            j = self.spec.path_jitter
            overhead *= self._path_rng.uniform(1.0 - j, 1.0 + j)
        self.loop.after(overhead, lambda: self._route(rid))

    def _refused(self, req: BenchRequest) -> str:
        """The front door's prompt limits (`check_raw_request`, `FrontDoor._prepare`)."""
        lim = self.input_limits
        if req.prompt_text and len(req.prompt_text) > lim.max_prompt_chars:
            return f"{len(req.prompt_text)} characters; at most {lim.max_prompt_chars}"
        if len(req.prompt_ids) > lim.max_prompt_tokens:
            return lim.too_many_tokens(len(req.prompt_ids))
        return ""

    def _over_capacity(self, req: BenchRequest) -> str:
        """`LLMEngine.validate`'s capacity rule on the smallest instance: a request whose
        prompt + max_tokens needs more blocks than the pool has can never run."""
        total = len(req.prompt_ids) + req.max_tokens
        for inst in self.instances.values():
            bs = inst.config.block_size
            if -(-total // bs) > inst.config.num_blocks:
                cap = inst.config.num_blocks * bs
                return (
                    f"prompt + max_tokens = {total} tokens exceeds this engine's KV capacity "
                    f"of {cap} tokens"
                )
        return ""

    def _route(self, rid: str) -> None:
        st = self._reqs[rid]
        req = st.req
        st.route = RouteRequest(
            rid, req.prompt_ids, session_id=req.session_id or "", hasher=self._hasher
        )
        if self.length is None:
            self._place(rid)
            return
        assert self.aio is not None
        job = Job(
            request_id=rid,
            token_ids=list(req.prompt_ids),
            params=SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
            session_id=req.session_id or "",
            prompt_text=req.prompt_text,
            oracle_tokens=req.oracle_tokens or req.max_tokens,  # ignore_eos: the true length
        )
        st.job = job
        # the front door: predict (Orchestrator.predict), then one admission turn
        coro = self.length.predict(job, st.route, self._block_size())
        st.pred = self.aio.run(coro, needs_loop=bool(req.prompt_text) and self.length.is_needed())
        if self.admission is None:
            self._admitted(rid)
            return
        pred, cm = st.pred, self.admission.admit(ANONYMOUS)
        st.admission = cm

        async def turn() -> None:
            p = await cm.__aenter__()
            try:
                await p.turn(pred.predicted_tokens)
            except OverloadedError as exc:
                st.admit_error = f"RESOURCE_EXHAUSTED: {exc}"
                st.admission = None
                await cm.__aexit__(None, None, None)

        def turned() -> None:
            if st.admit_error:
                self._fail(rid, st.admit_error)
                return
            self.admitted.append(rid)
            self.loop.after(0.0, lambda: self._admitted(rid))

        self.aio.start(turn(), turned)
        # the queue's timeout expires in simulated time: look at it then
        self.loop.after(self.admission.config.timeout_s, self.aio.pump)

    def _admitted(self, rid: str) -> None:
        """Orchestrator._attempt: the attempt's route from the request's prediction."""
        st = self._reqs[rid]
        assert self.length is not None and st.pred is not None and st.job is not None
        assert st.route is not None
        self.length.route(st.pred, st.job, st.route)
        self._place(rid)

    def _place(self, rid: str) -> None:
        st = self._reqs[rid]
        req = st.req
        assert st.route is not None
        if self.registry.candidates(ROLE_PREFILL) and req.max_tokens <= 1:
            # Orchestrator._prefill_only: nothing to decode, so no Reserve and no push
            pre = self._pick(ROLE_PREFILL, st.route, None)
            st.prefill = pre
            self.registry.charge(pre.instance_id, requests=1, tokens=len(req.prompt_ids))
            self._start_prefill(rid, pre, prefill_only=True)
        elif self.registry.candidates(ROLE_PREFILL) and self.registry.candidates(ROLE_DECODE):
            st.queue_deadline = self.loop.now + self.spec.kv_queue_timeout_s
            st.reserve_started = self.loop.now
            self._reserve(rid)
        elif self.registry.candidates(ROLE_COLOCATED):
            inst = self._pick(ROLE_COLOCATED, st.route, None)
            self.registry.charge(inst.instance_id, requests=1, tokens=len(req.prompt_ids))
            st.prefill = inst
            self._start_prefill(rid, inst, prefill_only=False)
        else:
            self._fail(rid, "no instance available")

    def _pick(
        self, role: int, route: RouteRequest, decode: SimInstance | None, exclude=()
    ) -> SimInstance:
        cands = [c for c in self.registry.candidates(role) if c.instance_id not in exclude]
        if role == ROLE_DECODE:
            picked = self.policy.pick_decode(route, cands).instance_id
            self.placements[picked] += 1
            return self.instances[picked]
        chosen = self.policy.pick_prefill(route, cands)
        self.placements[chosen.instance_id] += 1
        dec = self.registry.get(decode.instance_id) if decode is not None else None
        self.policy.on_routed(route, chosen, dec)
        return self.instances[chosen.instance_id]

    # ------------------------------------------------------------------ disaggregated
    def _reserve(self, rid: str, tried: set[str] | None = None) -> None:
        st = self._reqs[rid]
        assert st.route is not None
        tried = set() if tried is None else tried
        while True:
            cands = [c for c in self.registry.candidates(ROLE_DECODE) if c.instance_id not in tried]
            if not cands:
                break
            dec = self._pick(ROLE_DECODE, st.route, None, tried)
            tried.add(dec.instance_id)
            if dec.busy and dec.step_end > self.loop.now:
                # Reserve is an engine command: the engine thread runs it between two steps
                self._after_step(dec, lambda dec=dec: self._try_reserve(rid, dec, tried))
                return
            if self._try_reserve(rid, dec, tried, go_on=False):
                return
        # every decode full: `Capacity.wait` until the registry changes (woken by
        # `_capacity_changed`) or `recheck_s` passes; past the deadline: overloaded
        left = st.queue_deadline - self.loop.now
        if left <= 0:
            self._fail(rid, "RESOURCE_EXHAUSTED: no decode instance has free KV blocks")
            return
        self._kv_waits += 1
        n_wait = self._kv_waits
        self._kv_waiting[rid] = n_wait

        def recheck() -> None:
            if self._kv_waiting.get(rid) != n_wait:
                return  # woken by a change meanwhile
            del self._kv_waiting[rid]
            if self.loop.now >= st.queue_deadline:
                self._fail(rid, "RESOURCE_EXHAUSTED: no decode instance has free KV blocks")
            else:
                self._reserve(rid)

        self.loop.after(min(left, self.recheck_s), recheck)

    def _capacity_changed(self) -> None:
        """`Capacity.changed` (a registry listener): every capacity wait tries again."""
        if not self._kv_waiting:
            return
        waiting, self._kv_waiting = list(self._kv_waiting), {}
        for rid in waiting:
            self.loop.after(0.0, self._retry_cb(rid))

    def _retry_cb(self, rid: str) -> Callable[[], None]:
        return lambda: self._reserve(rid)

    def _try_reserve(self, rid: str, dec: SimInstance, tried: set[str], go_on: bool = True) -> bool:
        """Reserve on `dec`; on success start the prefill. Else (go_on) try the others."""
        st = self._reqs[rid]
        assert st.route is not None
        n = len(st.req.prompt_ids)
        # the decode worker's Reserve: prompt + token 0 + the router's headroom when free,
        # else without the headroom (best effort)
        extra = max(0, st.route.reserve_tokens)
        if dec.reserve(rid, n + 1 + extra, n) or (extra > 0 and dec.reserve(rid, n + 1, n)):
            self.registry.charge(dec.instance_id, requests=1)
            st.decode = dec

            def reserved() -> None:  # the ticket is back at the router: pick a prefill
                st.rec.stages["reserve_ms"] = (self.loop.now - st.reserve_started) * 1e3
                if self.length is not None and st.pred is not None:
                    self.length.placed(st.pred, dec.instance_id, n, st.route)
                pre = self._pick(ROLE_PREFILL, st.route, dec)
                st.prefill = pre
                self.registry.charge(pre.instance_id, requests=1, tokens=n)
                self._start_prefill(rid, pre, prefill_only=True)

            if dec.costs.reserve_s > 0.0:
                self.loop.after(dec.costs.reserve_s, reserved)
            else:
                reserved()
            return True
        if go_on:
            self._reserve(rid, tried)
        return False

    # ------------------------------------------------------------------ prefill (or colocated)
    def _start_prefill(self, rid: str, inst: SimInstance, prefill_only: bool) -> None:
        st = self._reqs[rid]
        st.worker_arrival = self.loop.now
        prompt = st.req.prompt_ids
        inst.tokens_in_flight += len(prompt)
        delay = 0.0
        hashes: list[bytes] = []
        wanted: list[bytes] = []
        if self.store is not None:  # the worker's fetch_prefix: what the store has beyond us
            hashes = inst.hashes(prompt)
            n_local = inst.cached_prefix_blocks(hashes)
            keys = [_key(h) for h in hashes]
            ns = inst.config.namespace
            if self._parts is None:
                n_store = self.store.lookup(ns, keys)
            else:  # the hit's window parts must be stored too
                n_store, _ = self.store.windows.lookup(ns, keys, self._parts[2])
            if n_store > n_local:
                wanted = hashes[n_local:n_store]
                delay = inst.costs.kvstore_fetch.time_s(self._fetch_bytes(len(wanted)))

        def admit() -> None:
            if wanted:  # ImportAndHold when the fetch landed
                # a layered fetch brings the window layers of its last window_blocks only
                window_from = 0 if self._parts is None else max(0, len(wanted) - self._parts[2])
                imported = inst.import_cached(wanted, window_from)
                st.kvstore_tokens = imported * inst.config.block_size
                inst.kv.hold_prefix(rid, hashes)
            inst.add(rid, prompt, st.req.max_tokens, prefill_only).record = st.rec
            self._kick(inst)

        if delay > 0:
            self.loop.after(delay, admit)
        else:
            admit()

    def _kick(self, inst: SimInstance) -> None:
        if inst.busy:
            return
        planned = inst.plan(cold=self.loop.now - inst.step_end >= inst.costs.cold_after_s)
        if planned is None:
            return
        plan, dur = planned
        inst.busy = True
        self._stepping += 1
        if self._shared_host:
            inst.step_plan, inst.step_started, inst.work_left = plan, self.loop.now, dur
            inst.step_rate = 0.0  # not yet timed: `_retime` schedules its end
            self._retime()
            return
        inst.step_end = self.loop.now + dur
        self.loop.after(dur, lambda: self._step_done(inst, plan, dur))

    def _retime(self) -> None:
        """Re-time every step in flight after the number of stepping instances changed. A
        step runs at rate 1 / `neighbour_busy_factor` while another instance steps and at
        rate 1 alone: its cost is charged for the time the neighbour actually steps, not
        all or nothing by the neighbour's state when it started. `work_left` is the step's
        seconds left at rate 1; a changed end invalidates the end scheduled before it."""
        now = self.loop.now
        for inst in self.instances.values():
            if not inst.busy:
                continue
            if inst.step_rate > 0.0:
                inst.work_left = max(
                    0.0, inst.work_left - (now - inst.step_marked) * inst.step_rate
                )
            inst.step_marked = now
            others = self._stepping - 1
            rate = 1.0
            if others and not inst.costs.neighbour_points:
                rate = 1.0 / inst.costs.neighbour_busy_factor
            elif others:  # a factor by the neighbours' sequences in flight
                seqs = sum(
                    len(o.step_plan.scheduled)
                    for o in self.instances.values()
                    if o.busy and o is not inst and o.step_plan is not None
                )
                rate = 1.0 / inst.costs.neighbour_factor(seqs)
            if rate == inst.step_rate:
                continue
            inst.step_rate = rate
            inst.step_end = now + inst.work_left / rate
            inst.step_gen += 1
            self.loop.at(
                inst.step_end,
                lambda inst=inst, gen=inst.step_gen: self._shared_step_done(inst, gen),
            )

    def _shared_step_done(self, inst: SimInstance, gen: int) -> None:
        if gen != inst.step_gen or not inst.busy:
            return  # re-timed since: a later end is scheduled
        self._step_done(inst, inst.step_plan, self.loop.now - inst.step_started)

    def _after_step(self, inst: SimInstance, fn: Callable[[], None]) -> None:
        """`fn` when the step in flight on `inst` ends; a re-timed step is waited for again."""
        steps = inst.steps

        def fire() -> None:
            if inst.busy and inst.steps == steps and inst.step_end > self.loop.now:
                self.loop.at(inst.step_end, fire)  # the same step, stretched meanwhile
                return
            fn()

        self.loop.at(inst.step_end, fire)

    def _step_done(self, inst: SimInstance, plan, dur: float) -> None:
        inst.busy = False
        self._stepping -= 1
        if self._shared_host:
            self._retime()  # the others may run alone now
        length = self.length
        if length is not None:  # progress() and done() share the length state: in order
            for seq, reason in inst.finish_step(plan, dur).produced:
                self._produced(inst, seq, reason)
            self._kick(inst)
            return
        # The hot path, in one pass over the step's tokens: a decode token of a running
        # request (`_produced`'s first case, its `_emit` inlined) touches only its own
        # record, so it goes out at once; the others (finished requests, a colocated first
        # token) go to `_produced` after every finish of the step, in order, as
        # `finish_step` + a loop over its result does. The role and the clock cannot change
        # within this loop.
        t = self.loop.now + inst.costs.token_overhead_s
        colocated = inst.role == ROLE_COLOCATED
        rest: list[tuple[Seq, str | None]] = []
        for entry in inst.advance(plan, dur):
            seq: SimSeq = entry.seq  # type: ignore[assignment]
            n = len(seq.output_token_ids)
            if n < seq.finish_at:
                if not colocated or n > 1:
                    rec = seq.record  # reqs[seq.request_id].rec
                    rec.token_times.append(t)
                    rec.n_out += 1
                else:
                    rest.append((seq, None))
            else:
                rest.append((seq, inst.finish(seq)))
        for seq, reason in rest:
            self._produced(inst, seq, reason)
        self._kick(inst)

    def _produced(self, inst: SimInstance, seq: Seq, reason: str | None) -> None:
        rid = seq.request_id
        st = self._reqs[rid]
        now = self.loop.now
        if reason is None and (inst.role != ROLE_COLOCATED or len(seq.output_token_ids) > 1):
            self._emit(st, now + inst.costs.token_overhead_s)  # a decode token (hot path)
            return
        if reason == "prefill_done":
            self._prefill_done(rid, inst, seq)
            return
        if seq.num_output_tokens == 1 and inst.role == ROLE_COLOCATED:
            st.rec.cached_tokens = seq.num_cached_tokens
            st.rec.stages["prefill_ms"] = (now - st.worker_arrival) * 1e3
            st.first_token_at = now
            inst.tokens_in_flight -= len(st.req.prompt_ids)
            self._publish(inst, st.req.prompt_ids)
        self._emit(st, now + inst.costs.token_overhead_s)
        if reason is not None:
            self._finish(rid, inst, now)

    def _prefill_done(self, rid: str, inst: SimInstance, seq: Seq) -> None:
        st = self._reqs[rid]
        now = self.loop.now
        n = len(st.req.prompt_ids)
        inst.tokens_in_flight -= n
        st.rec.cached_tokens = seq.num_cached_tokens
        st.rec.stages["prefill_ms"] = (now - st.worker_arrival) * 1e3
        self._publish(inst, st.req.prompt_ids)
        dec = st.decode
        if dec is None:  # a 1-token request: token 0 in the Prefill answer, nothing pushed
            self.registry.charge(inst.instance_id, tokens=-n)
            st.first_token_at = now
            self._emit(st, now + inst.costs.token_overhead_s)
            self._finish(rid, inst, now)
            return
        # the worker pushes every block of the prompt (`num_blocks_for(prompt)`; a layered
        # model's sliding layers their last window only)
        nbytes = inst.costs.transfer_bytes(n, inst.config.block_size)
        t_xfer = inst.costs.transfer.time_s(nbytes)
        st.rec.stages["transfer_ms"] = t_xfer * 1e3
        st.rec.stages["transfer_bytes"] = float(nbytes)

        def landed() -> None:
            t = self.loop.now
            self.registry.charge(inst.instance_id, requests=-1, tokens=-n)
            st.first_token_at = t
            self._emit(st, t + inst.costs.token_overhead_s)
            if st.req.max_tokens <= 1:
                dec.unreserve(rid)
                self._finish(rid, dec, t)
                return
            seq = dec.add_prefilled(rid, st.req.prompt_ids, SAMPLED_TOKEN, st.req.max_tokens)
            seq.record = st.rec
            st.rec.stages["queue_ms"] = 0.0  # early admission: decoding starts at landing
            self._kick(dec)

        self.loop.after(t_xfer, landed)

    def _emit(self, st: _Req, t: float) -> None:
        st.rec.token_times.append(t)
        st.rec.n_out += 1
        if st.pred is not None and self.length is not None:
            self.length.progress(st.pred, 1)

    def _finish(self, rid: str, inst: SimInstance, now: float) -> None:
        st = self._reqs[rid]
        st.rec.finish_s = now + inst.costs.token_overhead_s
        st.rec.finish_reason = "length"
        st.rec.stages["decode_ms"] = (now - st.first_token_at) * 1e3
        st.rec.stages["cached_tokens"] = float(st.rec.cached_tokens)
        st.rec.stages["kvstore_tokens"] = float(st.kvstore_tokens)
        if inst.role == ROLE_COLOCATED:
            self.registry.charge(inst.instance_id, requests=-1, tokens=-len(st.req.prompt_ids))
        else:
            self.registry.charge(inst.instance_id, requests=-1)
        self._pending -= 1
        self._ended(st, True)
        if self.stop_slo is not None:
            ttft, tpot = st.rec.ttft_s, st.rec.tpot_s
            late = ttft is None or ttft * 1000.0 > self._stop_ms[0]
            if late or (tpot is not None and tpot * 1000.0 > self._stop_ms[1]):
                self.misses += 1
        self._draining_check()

    def _fail(self, rid: str, error: str) -> None:
        st = self._reqs[rid]
        st.rec.error = error
        self._pending -= 1
        self._ended(st, False)

    def _ended(self, st: _Req, finished: bool) -> None:
        """The request ended: the length is learned (demand leaves the decode) and its
        admission pass is given back, which lets the next waiter in (in the queue's order)."""
        if st.pred is not None and self.length is not None:
            self.length.done(st.pred, st.rec.n_out if finished else 0, finished)
        if st.admission is not None:
            assert self.aio is not None
            cm, st.admission = st.admission, None
            self.aio.run(cm.__aexit__(None, None, None), needs_loop=False)
            self.aio.pump()  # waiters the queue let in continue (in its order)

    def _publish(self, inst: SimInstance, prompt: Sequence[int]) -> None:
        """The worker's write-back (off the critical path): publish the prompt's full blocks."""
        if self.store is None:
            return
        hashes = [_key(h) for h in inst.hashes(prompt)]
        if not hashes:
            return
        ns = inst.config.namespace
        if self._parts is not None:
            self._publish_parts(ns, hashes)
            return
        res = self.store.begin_put(ns, hashes, self.store.contains(ns, hashes), 1)
        if res is not None and res.slots:
            self.store.commit_put(res.put_id, [b""] * len(res.slots))

    def _fetch_bytes(self, num_blocks: int) -> int:
        """Bytes a kvstore fetch of `num_blocks` blocks moves (a layered hit: main parts, and
        the window parts of its last window_blocks)."""
        if self._parts is None:
            return num_blocks * self._store_block_bytes
        main_b, win_b, wb = self._parts
        return num_blocks * main_b + min(num_blocks, wb) * win_b

    def _publish_parts(self, ns: str, hashes: list[bytes]) -> None:
        """`KVReuse._publish_parts` of a prefill (it holds every block's KV): main parts the
        store lacks, then window parts of the last window_blocks blocks stored."""
        assert self.store is not None and self._parts is not None
        main_b, win_b, wb = self._parts
        hit, n_main = self.store.windows.lookup(ns, hashes, wb)
        if hit >= len(hashes):
            return
        res = self.store.begin_put(ns, hashes, n_main, main_b)
        if res is not None and res.slots:
            self.store.commit_put(res.put_id, [b""] * len(res.slots))
        end = self.store.contains(ns, hashes)
        res = self.store.begin_put(ns, hashes[:end], max(0, end - wb), win_b, window=True)
        if res is not None and res.slots:
            self.store.commit_put(res.put_id, [b""] * len(res.slots))

    # ------------------------------------------------------------------ flips
    def _flip_tick(self) -> None:
        assert self.flip_policy is not None
        decision = self.flip_policy.decide(snapshot(self.registry, self.demand), self.loop.now)
        if decision.action == "flip":
            inst = self.instances[decision.instance_id]
            reg = self.registry.get(inst.instance_id)
            if reg is not None:
                reg.state = "flipping"
            self.flips.append(
                {"t": self.loop.now, "instance": inst.instance_id, "to": decision.to_role}
            )
            inst.flip_to = decision.to_role
            self._draining_check()
        if self._pending:
            self.loop.after(self.spec.flip_interval_s, self._flip_tick)

    def _draining_check(self) -> None:
        for inst in self.instances.values():
            to = inst.flip_to
            if not to or inst.has_work() or inst.kv.num_reservations:
                continue
            reg = self.registry.get(inst.instance_id)
            if reg is not None and reg.inflight_requests:
                continue
            inst.flip_to = 0

            def switch(inst: SimInstance = inst, to: int = to) -> None:
                inst.role = to
                r = self.registry.get(inst.instance_id)
                if r is not None:
                    r.role, r.state = to, "serving"
                if self.admission is not None:  # the running limit follows serving decodes
                    self.admission.dispatch()
                    assert self.aio is not None
                    self.aio.pump()
                assert self.flip_policy is not None
                self.flip_policy.flip_ended(self.loop.now)

            self.loop.after(self.spec.flip_switch_s, switch)

    # ------------------------------------------------------------------ reporting
    def engine_seconds(self) -> dict[str, float]:
        """{instance: seconds of engine work} (with `ClusterSpec.track_engine`)."""
        return {i.instance_id: i.engine_s for i in self.instances.values()}

    def utilisation(self, wall_s: float) -> dict[str, float]:
        return {
            i.instance_id: (i.busy_s / wall_s if wall_s > 0 else 0.0)
            for i in self.instances.values()
        }


def _key(h: bytes) -> bytes:
    return h[:16].ljust(16, b"\0")
