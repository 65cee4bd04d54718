"""RouterApp: wires registry, policy, predictor, orchestrator and servicers into
the shared service lifecycle (pdserve.rpc.server)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from pdserve.kv.hashing import block_hashes
from pdserve.logging import get_logger
from pdserve.rpc.metrics import Metrics
from pdserve.rpc.server import ServiceApp
from pdserve.v1 import router_pb2_grpc

from .flip import FlipController, FlipMetrics
from .flip_policy import FlipPolicy, FlipThresholds
from .metrics import RouterMetrics, Totals
from .model_info import ModelInfo
from .orchestrator import Deadlines, Orchestrator
from .policies import make_policy
from .predictor import EwmaPredictor
from .registry import ROLE_NAMES, Registry
from .servicer import RegistryServicer, RouterServicer
from .settings import RouterSettings
from .workers import WorkerClients

log = get_logger("pdserve.router")


class RouterApp(ServiceApp):
    name = "router"
    health_service_names = ("pdserve.v1.Router", "pdserve.v1.Registry")

    def __init__(self, settings: RouterSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.registry = Registry(
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            suspect_s=settings.heartbeat_interval_s,
        )
        self.policy = make_policy(settings.policy, settings.session_affinity)
        self.registry.on_forget(self.policy.forget)
        self.workers = WorkerClients()
        self.raw_metrics = metrics if metrics is not None else Metrics()
        self.metrics = RouterMetrics(self.raw_metrics)
        self.totals = Totals()
        self.model = ModelInfo()
        # Built in start(), once the model directory is read (EOS ids, tokenizer):
        self.orchestrator: Orchestrator | None = None
        self.router_servicer: RouterServicer | None = None
        self._tasks: list[asyncio.Task] = []
        self.flip: FlipController | None = None  # set when settings.flip_enabled

    def _prefix_hashes(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """Router-local prefix identity for prefix-aware placement: any KV namespace shared
        by all instances works, so the cluster's model fingerprint seeds the chain."""
        return block_hashes(token_ids, block_size, self.registry.model_fingerprint or "")

    def _orchestrator(self, model: ModelInfo) -> Orchestrator:
        s = self.settings
        with_kvstore = bool(s.kvstore_addr) and s.use_kvstore
        return Orchestrator(
            self.registry,
            self.policy,
            EwmaPredictor(alpha=s.predictor_alpha, initial=s.predictor_initial),
            self.workers,
            Deadlines(
                reserve_s=s.reserve_deadline_s,
                kv_queue_s=s.kv_queue_timeout_s,
                prefill_s=s.prefill_deadline_s,
                first_token_s=s.first_token_deadline_s,
                decode_idle_s=s.decode_idle_deadline_s,
                abort_s=s.abort_deadline_s,
            ),
            eos_token_ids=model.eos_token_ids,
            max_prefill_attempts=s.max_prefill_attempts,
            lease_s=s.lease_s,
            use_kvstore=with_kvstore,
            write_back=with_kvstore,
            hasher=self._prefix_hashes,
        )

    async def start(self, server) -> None:
        s = self.settings
        kv = s.kvstore_addr or ""
        self.model = await asyncio.to_thread(ModelInfo.from_dir, s.model)
        self.orchestrator = self._orchestrator(self.model)
        self.router_servicer = RouterServicer(
            self.orchestrator, self.registry, self.model, self.metrics, self.totals, kv
        )
        router_pb2_grpc.add_RouterServicer_to_server(self.router_servicer, server)
        router_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(self.registry, s.heartbeat_interval_s, kv), server
        )
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        if s.flip_enabled:
            self.flip = self._flip_controller()
            self._tasks.append(asyncio.create_task(self.flip.run()))
        log.info(
            "router ready",
            model=self.model.name or None,
            policy=self.policy.name,
            kvstore=kv or None,
            flip=s.flip_enabled,
        )

    def _flip_controller(self) -> FlipController:
        s = self.settings
        thresholds = FlipThresholds(
            prefill_tokens_full=s.flip_prefill_tokens,
            decode_seqs_full=s.flip_decode_seqs,
            starved=s.flip_starved,
            ratio=s.flip_ratio,
            ticks=s.flip_ticks,
            cooldown_s=s.flip_cooldown_s,
        )
        return FlipController(
            self.registry,
            self.workers,
            FlipPolicy(thresholds),
            FlipMetrics(self.raw_metrics),
            interval_s=s.flip_interval_s,
            set_role_timeout_s=s.flip_timeout_s,
            on_role_changed=self.policy.forget,  # prefix LRU / session affinity of the old role
        )

    async def drain(self) -> None:
        """Refuse new requests, wait for the running ones."""
        if self.router_servicer is not None:
            await self.router_servicer.drain()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.orchestrator is not None:
            await self.orchestrator.close()
        await self.workers.close()

    async def _housekeeping(self) -> None:
        """Expire silent instances; refresh the per-instance gauges."""
        period = min(self.settings.heartbeat_interval_s, self.settings.heartbeat_timeout_s / 3)
        while True:
            await asyncio.sleep(period)
            for iid in self.registry.expire():
                log.warning("instance expired (no heartbeat)", instance=iid)
            live = {inst.address for inst in self.registry.instances()}
            for address in [a for a in self.workers.addresses() if a not in live]:
                await self.workers.drop(address)
            counts = dict.fromkeys(ROLE_NAMES.values(), 0)
            for inst in self.registry.instances():
                counts[inst.role_name] += 1
                self.metrics.inflight.labels(inst.instance_id, inst.role_name).set(
                    inst.inflight_requests
                )
            for role, n in counts.items():
                self.metrics.instances.labels(role).set(n)
