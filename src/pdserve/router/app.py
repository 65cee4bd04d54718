"""RouterApp: wires registry, policy, predictor, orchestrator and servicers into
the shared service lifecycle (pdserve.rpc.server)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.kv.hashing import block_hashes
from pdserve.logging import get_logger
from pdserve.rpc.advertise import advertised_address
from pdserve.rpc.channels import SERVER_OPTIONS
from pdserve.rpc.metrics import Metrics
from pdserve.rpc.reflection import enable_reflection
from pdserve.rpc.server import ServiceApp
from pdserve.v1 import router_pb2_grpc

from .cluster.peers import PeerRouters, RouterIdentity
from .cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_NAMES, Instance, Registry
from .cluster.servicer import RegistryServicer
from .cluster.workers import WorkerClients
from .flip.controller import FlipController, FlipMetrics
from .flip.policy import FlipPolicy, FlipThresholds
from .frontdoor.auth import ApiKeys
from .frontdoor.door import FrontDoor
from .frontdoor.http.app import OpenAIApp
from .frontdoor.http.server import HttpServer
from .frontdoor.input_limits import InputLimits
from .frontdoor.model_info import ModelInfo
from .frontdoor.resume import ResumeTokens, load_secret
from .frontdoor.servicer import RouterServicer
from .job import Deadlines
from .lifecycle.orchestrator import Orchestrator
from .lifecycle.stream_watch import STALL_S
from .metrics import RouterMetrics, Totals
from .replicas.key_limits import SharedKeyLimits
from .replicas.leader import Leadership
from .replicas.store import SharedStore
from .scheduling.admission import Admission, AdmissionConfig
from .scheduling.demand import DecodeDemand
from .scheduling.factory import make_policy
from .scheduling.length import LengthMetrics, LengthScheduling
from .scheduling.predictor import EwmaPredictor, OraclePredictor, OutputLengthPredictor
from .settings import RouterSettings

log = get_logger("pdserve.router")
# Listed by server reflection (with the health service and reflection itself).
PUBLIC_SERVICES = ("pdserve.v1.Router",)
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"  # public: what grpcurl lists


def admission_config(s: RouterSettings) -> AdmissionConfig:
    """The admission stage's settings (the simulator builds its `Admission` from these too)."""
    return AdmissionConfig(
        max_running=s.admission.max_running,
        max_running_per_decode=s.admission.queue_max_running_per_decode,
        running_per_slot=s.admission.running_per_batch_slot,
        max_queue=s.admission.max_queue,
        timeout_s=s.admission.queue_timeout_s,
        order=s.admission.queue_order,
        aging_tokens_per_s=s.admission.queue_aging_tokens_per_s,
        max_wait_s=s.admission.queue_max_wait_s,
        max_bypass=s.admission.queue_max_bypass,
    )


def mixed_memory(decodes: Sequence[Instance]) -> bool:
    """Whether serving decodes hold KV pools of different sizes (length routing acts)."""
    return len({i.load.total_blocks * i.block_size for i in decodes}) > 1


def predictions_needed(s: RouterSettings, mixed_decodes: bool = False) -> bool:
    """Whether anything reads the length prediction; when nothing does, the router does not
    run the predictor per request (nor learn). Length routing reads it only on a decode
    pool of mixed memory (`mixed_decodes`)."""
    sjf_queue = s.admission.queue_order == "sjf" and (
        s.admission.max_running or s.admission.queue_max_running_per_decode
    )
    return bool(
        sjf_queue
        or s.placement.decode_placement == "predicted"
        or (s.placement.decode_placement == "length" and mixed_decodes)
        or s.placement.reserve_max_tokens > 0
        or s.flip.flip_enabled
        or s.length.predictor_oracle
    )


class _Cached:
    """`fn()`, computed again at most every `ttl_s` seconds (not per request)."""

    def __init__(self, fn: Callable[[], int], ttl_s: float) -> None:
        self._fn, self._ttl_s = fn, ttl_s
        self._value, self._at = 0, -math.inf

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self._at >= self._ttl_s:
            self._value, self._at = self._fn(), now
        return self._value


class RouterApp(ServiceApp):
    name = "router"
    health_service_names = ("pdserve.v1.Router", "pdserve.v1.Registry")
    tls_name = "router"
    # Public plane: the client API (and whatever a front door adds, e.g. reflection);
    # the Registry is served on the internal listener only (settings.internal_port).
    public_services: tuple[str, ...] = (*PUBLIC_SERVICES, REFLECTION_SERVICE)

    def public_server_options(self):
        limit = self.settings.limits.max_request_bytes
        return [
            *((k, v) for k, v in SERVER_OPTIONS if k != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", limit),
        ]

    def __init__(self, settings: RouterSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.registry = Registry(
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            suspect_s=settings.heartbeat_interval_s,
        )
        self.demand = DecodeDemand()  # predicted decode demand (placement, flip, metrics)
        self.policy = make_policy(
            settings.placement.policy,
            settings.placement.session_affinity,
            settings.placement.decode_placement,
            self.demand,
            settings.placement.length_routing_tokens,
        )
        self.registry.on_forget(self.policy.forget)
        self.registry.on_forget(self.demand.forget)
        self.workers = WorkerClients()
        self.raw_metrics = metrics if metrics is not None else Metrics()
        self.metrics = RouterMetrics(self.raw_metrics)
        self.registry.on_forget(self.metrics.forget_instance)  # no gauges of departed instances
        self.totals = Totals()
        self.model = ModelInfo()
        # Built in start(), once the model directory is read (EOS ids, tokenizer):
        self.orchestrator: Orchestrator | None = None
        self.router_servicer: RouterServicer | None = None
        self.front: FrontDoor | None = None
        self.http: HttpServer | None = None
        # Fails fast (before any port opens) on a bad keys file.
        self.keys = ApiKeys.load(
            settings.keys.api_key,
            settings.keys.api_keys_file,
            max_concurrent=settings.keys.key_max_concurrent,
            tokens_per_minute=settings.keys.key_tokens_per_minute,
        )
        self._tasks: list[asyncio.Task] = []
        self.flip: FlipController | None = None  # set when settings.flip.flip_enabled
        self.length: LengthScheduling | None = None  # built in start() (loads the predictor)
        # Router replicas: who this one is, the others (from worker reports), the shared store
        r = settings.replicas
        self.identity = RouterIdentity(r.router_id or settings.instance_id)
        self.peers = PeerRouters(self.identity)
        self.registry.on_forget(self.peers.forget)
        self.store = SharedStore(r.redis_url, self.raw_metrics) if r.redis_url else None
        self.shared_limits = (
            SharedKeyLimits(self.store, self.identity.router_id, self._replicas, r.key_lease_ttl_s)
            if self.store is not None
            else None
        )
        self.leadership = Leadership(self.store, self.identity.router_id, r.leader_ttl_s)
        self.admission = self._admission()  # the one admission stage (scheduling/admission.py)

    def _prefix_hashes(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """Router-local prefix identity for prefix-aware placement: any KV namespace shared
        by all instances works, so the cluster's model fingerprint seeds the chain."""
        return block_hashes(token_ids, block_size, self.registry.model_fingerprint or "")

    def _predictor(self) -> OutputLengthPredictor:
        s = self.settings
        predictor: OutputLengthPredictor
        if s.length.predictor == "ewma":
            predictor = EwmaPredictor(
                alpha=s.length.predictor_alpha, initial=s.length.predictor_initial
            )
        else:
            from .scheduling.predictor.offline import DEFAULT_DIR, TextLengthModel
            from .scheduling.predictor.online import OnlineLengthPredictor

            text_model = None
            if s.length.predictor_path != "none":
                text_model = TextLengthModel.load(s.length.predictor_path or DEFAULT_DIR)
            predictor = OnlineLengthPredictor(text_model, initial=s.length.predictor_initial)
        return OraclePredictor(predictor) if s.length.predictor_oracle else predictor

    def _serving(self) -> int:
        """Decode (or colocated) instances serving now: the admission limit's unit."""
        serving = self.registry.candidates(ROLE_DECODE) or self.registry.candidates(ROLE_COLOCATED)
        return len(serving)

    def _slots(self) -> int:
        """The batch slots of the serving decode (or colocated) instances: the sum of the
        max_num_seqs they report (0 when one does not say)."""
        serving = self.registry.candidates(ROLE_DECODE) or self.registry.candidates(ROLE_COLOCATED)
        slots = [i.load.max_num_seqs for i in serving]
        return 0 if not slots or 0 in slots else sum(slots)

    def _replicas(self) -> int:
        """Router replicas known now (itself included): the local share's divisor."""
        live = [i.instance_id for i in self.registry.instances()]
        return len(self.peers.known(live))

    def _resume_tokens(self) -> ResumeTokens:
        import secrets

        from pdserve.rpc.tls import files_from_settings

        s = self.settings
        tls = files_from_settings(s, self.tls_name)
        secret, source = load_secret(
            s.replicas.resume_secret_file,
            str(tls.key) if tls is not None else None,
            insecure_fallback=secrets.token_bytes(32),
        )
        log.info("resume tokens", secret=source, ttl_s=s.replicas.resume_token_ttl_s)
        return ResumeTokens(secret, s.replicas.resume_token_ttl_s)

    def _admission(self) -> Admission:
        s = self.settings
        slots = _Cached(self._slots, s.heartbeat_interval_s)  # (it changes with heartbeats)
        admission = Admission(
            self.raw_metrics,
            admission_config(s),
            serving=self._serving,
            slots=slots,
            shared=self.shared_limits,
        )
        self.registry.on_change(admission.capacity.changed)
        return admission

    def _predictions_needed(self) -> bool:
        """Whether anything reads the length prediction; when nothing does, the router does
        not run the predictor per request (nor learn). Asked per request: the decode pool's
        memory is known from the registry."""
        return predictions_needed(
            self.settings, mixed_memory(self.registry.candidates(ROLE_DECODE))
        )

    def _length_scheduling(self, predictor: OutputLengthPredictor) -> LengthScheduling:
        s = self.settings
        return LengthScheduling(
            predictor,
            demand=self.demand,
            needed=self._predictions_needed,
            reserve_max_tokens=s.placement.reserve_max_tokens,
            oracle=s.length.predictor_oracle,
            use_max_tokens=s.length.predictor_use_max_tokens,
            metrics=LengthMetrics(self.raw_metrics),
        )

    def _orchestrator(self, model: ModelInfo, length: LengthScheduling) -> Orchestrator:
        s = self.settings
        with_kvstore = bool(s.kvstore_addr) and s.use_kvstore
        return Orchestrator(
            self.registry,
            self.policy,
            self.workers,
            Deadlines(
                reserve_s=s.lifecycle.reserve_deadline_s,
                kv_queue_s=s.admission.kv_queue_timeout_s,
                prefill_s=s.lifecycle.prefill_deadline_s,
                first_token_s=s.lifecycle.first_token_deadline_s,
                decode_idle_s=s.lifecycle.decode_idle_deadline_s,
                abort_s=s.lifecycle.abort_deadline_s,
            ),
            eos_token_ids=model.eos_token_ids,
            max_prefill_attempts=s.lifecycle.max_prefill_attempts,
            lease_s=s.lifecycle.lease_s,
            use_kvstore=with_kvstore,
            write_back=with_kvstore,
            hasher=self._prefix_hashes,
            length=length,
            max_migrations=s.lifecycle.max_migrations,
            migration_wait_s=s.lifecycle.migration_wait_s,
            on_migration=lambda reason: self.metrics.migrations.labels(reason).inc(),
            capacity=self.admission.capacity,
        )

    async def start(self, server) -> None:
        s = self.settings
        kv = s.kvstore_addr or ""
        self.model = await asyncio.to_thread(ModelInfo.from_dir, s.model)
        self.length = self._length_scheduling(await asyncio.to_thread(self._predictor))
        self.orchestrator = self._orchestrator(self.model, self.length)
        self.front = FrontDoor(
            self.orchestrator,
            self.registry,
            self.model,
            self.metrics,
            self.totals,
            self.keys,
            self.admission,
            kv,
            limits=InputLimits.from_settings(s.limits, self.model.max_model_len),
            resume_tokens=await asyncio.to_thread(self._resume_tokens),
            peers=self.peers,
            shared_store=self.store,
        )
        self.router_servicer = RouterServicer(self.front)
        router_pb2_grpc.add_RouterServicer_to_server(self.router_servicer, server)
        router_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(
                self.registry,
                s.heartbeat_interval_s,
                kv,
                s.max_instances_per_identity,
                self.peers,
            ),
            server,
        )
        enable_reflection(server, PUBLIC_SERVICES)
        if s.http_port is not None:
            self.http = HttpServer(
                OpenAIApp(self.front, s.limits.max_request_bytes).app,
                s.host,
                s.http_port,
                grace_s=s.grace_s,
            )
            await self.http.start()
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        if self.store is not None:
            self.store.start()
            assert self.shared_limits is not None
            self.shared_limits.start()
        if s.flip.flip_enabled:
            self.flip = self._flip_controller()
            self._tasks.append(asyncio.create_task(self.flip.run()))
            if self.store is not None:
                self._tasks.append(asyncio.create_task(self.leadership.run()))
        log.info(
            "router ready",
            model=self.model.name or None,
            policy=self.policy.name,
            predictor=self.length.predictor.name,
            queue=s.admission.queue_order if self.admission.limit() else None,
            kvstore=kv or None,
            flip=s.flip.flip_enabled,
            http_port=self.http.port if self.http else None,
            api_keys=len(self.keys) or "open",
            router_id=self.identity.router_id,
            shared_store=self.store.describe() if self.store else None,
        )

    async def on_serving(self, port: int) -> None:
        """The public addresses are known now: workers report them to the other replicas."""
        r, host = self.settings.replicas, self.settings.host
        http = advertised_address(host, self.http.port, r.advertise_host) if self.http else ""
        self.identity = RouterIdentity(
            self.identity.router_id, advertised_address(host, port, r.advertise_host), http
        )
        self.peers.me = self.identity

    def ready_info(self) -> dict[str, Any]:
        return {"http_port": self.http.port} if self.http is not None else {}

    def _flip_controller(self) -> FlipController:
        s = self.settings
        thresholds = FlipThresholds(
            prefill_tokens_full=s.flip.flip_prefill_tokens,
            decode_seqs_full=s.flip.flip_decode_seqs,
            starved=s.flip.flip_starved,
            ratio=s.flip.flip_ratio,
            ticks=s.flip.flip_ticks,
            cooldown_s=s.flip.flip_cooldown_s,
        )
        return FlipController(
            self.registry,
            self.workers,
            FlipPolicy(thresholds),
            FlipMetrics(self.raw_metrics),
            interval_s=s.flip.flip_interval_s,
            set_role_timeout_s=s.flip.flip_timeout_s,
            on_role_changed=self.policy.forget,  # prefix LRU / session affinity of the old role
            demand=self.demand,
            may_flip=self.leadership.is_leader,  # one replica at a time (replicas/leader.py)
        )

    async def drain(self) -> None:
        """Refuse new requests (gRPC and HTTP), wait for the running ones."""
        if self.front is not None:
            await self.front.drain()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.orchestrator is not None:
            await self.orchestrator.close()
        await self.workers.close()
        if self.shared_limits is not None:
            await self.shared_limits.close()
        await self.leadership.release()
        if self.store is not None:
            await self.store.close()

    async def _housekeeping(self) -> None:
        """Expire silent instances; refresh the per-instance gauges. A tick that comes late
        by more than a period expires nothing: the router itself did not run, and the
        heartbeats it has not read yet may be waiting in its sockets."""
        period = min(self.settings.heartbeat_interval_s, self.settings.heartbeat_timeout_s / 3)
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + period
            await asyncio.sleep(period)
            late = loop.time() - due > max(period, STALL_S)
            for iid in [] if late else self.registry.expire():
                log.warning("instance expired (no heartbeat)", instance=iid)
            live = {inst.address for inst in self.registry.instances()}
            for address in [a for a in self.workers.addresses() if a not in live]:
                self.workers.drop(address)
            counts = dict.fromkeys(ROLE_NAMES.values(), 0)
            for inst in self.registry.instances():
                counts[inst.role_name] += 1
                self.metrics.set_inflight(inst.instance_id, inst.role_name, inst.inflight_requests)
            for role, n in counts.items():
                self.metrics.instances.labels(role).set(n)
            self.admission.dispatch()  # the limit grows when instances join
            if self.length is not None:
                decodes = [
                    i.instance_id for i in self.registry.instances() if i.role == ROLE_DECODE
                ]
                self.length.refresh_gauges(decodes)
