"""The load a worker reports with every heartbeat, shared by the worker (which fills it) and
the router (which places requests by it). Torch-free; mirrors `pdserve.v1.WorkerLoad`."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.v1 import common_pb2


@dataclass(frozen=True)
class LoadReport:
    num_waiting: int = 0  # queued sequences (not yet scheduled)
    num_running: int = 0  # sequences in the running batch
    free_blocks: int = 0  # KV blocks free, evictable cached ones included
    total_blocks: int = 0
    tokens_in_flight: int = 0  # prompt tokens of the requests in flight
    num_reserved: int = 0  # decode: reservations waiting for KV or their Decode call
    step_ms_ewma: float = 0.0
    max_num_seqs: int = 0  # the most sequences its batch runs at once (0: unknown)

    def to_proto(self) -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            free_blocks=self.free_blocks,
            total_blocks=self.total_blocks,
            tokens_in_flight=self.tokens_in_flight,
            num_reserved=self.num_reserved,
            step_ms_ewma=self.step_ms_ewma,
            max_num_seqs=self.max_num_seqs,
        )

    @classmethod
    def from_proto(cls, load: common_pb2.WorkerLoad) -> LoadReport:
        return cls(
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            free_blocks=load.free_blocks,
            total_blocks=load.total_blocks,
            tokens_in_flight=load.tokens_in_flight,
            num_reserved=load.num_reserved,
            step_ms_ewma=load.step_ms_ewma,
            max_num_seqs=load.max_num_seqs,
        )
