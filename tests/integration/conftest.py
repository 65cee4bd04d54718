"""Fixtures and helpers of the end-to-end serving tests: one tiny checkpoint (with tokenizer,
from `pdserve.model.tiny`), clusters of real processes on 127.0.0.1, the in-process engine as
reference, and a worker's Info counters. Every wait here is bounded (hang guards only)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

BLOCK_SIZE = 16
MAX_POS = 256  # the context length: small, so "prompt longer than the context" is cheap
VOCAB = 512


@pytest.fixture(scope="session")
def serving_model_dir(tmp_path_factory) -> Path:
    """A tiny llama (hidden 64, 2 layers, vocab 512) with tokenizer.json (the router needs it)."""
    from pdserve.model.tiny import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("serving-tiny")
    return Path(make_tiny(root / "llama", TinySpec(vocab=VOCAB, max_pos=MAX_POS)))


@pytest.fixture(scope="session")
def reference_engine(serving_model_dir):
    """The in-process engine on the same checkpoint (the expected tokens)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model_dir=str(serving_model_dir),
            dtype="float32",  # the workers' dtype in tests (tests/conftest.py pins it)
            num_blocks=256,
            block_size=BLOCK_SIZE,
        )
    )


def reference_tokens(engine, requests: Sequence[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy, ignore_eos tokens of each (prompt, max_tokens), all in one batch."""
    from pdserve.engine.params import SamplingParams

    out: dict[str, list[int]] = {}
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"ref-{i}", prompt, params)
        out[f"ref-{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"ref-{i}"] for i in range(len(requests))]


def engine_tokens(engine, requests: Sequence[dict]) -> list[list[int]]:
    """The in-process engine's tokens for SDK `generate` arguments (greedy or seeded), all in
    one batch."""
    from pdserve.engine.params import SamplingParams

    out: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        params = SamplingParams(
            max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r.get("top_p", 1.0),
            seed=r.get("seed"), ignore_eos=True,
        )  # fmt: skip
        engine.add_request(f"ref-{i}", r["token_ids"], params)
        out[f"ref-{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"ref-{i}"] for i in range(len(requests))]


def mixed_requests(n: int, seed: int, max_len: int = 100) -> list[tuple[list[int], int]]:
    """n (prompt, max_tokens): lengths 1..max_len incl. block boundaries (15, 16, 17, 32, 33),
    distinct random prompts (no shared prefixes, so no prefix-cache hits)."""
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 32, 33, 64, max_len]
    lengths += [rng.randint(1, max_len) for _ in range(n - len(lengths))]
    return [
        ([rng.randint(2, VOCAB - 1) for _ in range(length)], rng.randint(1, 24))
        for length in lengths[:n]
    ]


def start_cluster(model_dir: Path, **kw):
    """A started `Cluster` (caller stops it). Small KV pools and the tiny model."""
    from pdserve.launcher import Cluster, ClusterConfig

    kw.setdefault("worker_args", ["--num-blocks", "256", "--max-num-batched-tokens", "512"])
    cluster = Cluster(ClusterConfig(model=str(model_dir), port=0, **kw))
    cluster.start(timeout=180.0)
    return cluster


@pytest.fixture(scope="session")
def cluster_1p1d(serving_model_dir) -> Iterator:
    """One prefill + one decode, shared by the cancel and bad-input tests."""
    cluster = start_cluster(serving_model_dir, prefill=1, decode=1)
    try:
        yield cluster
    finally:
        cluster.stop()


def worker_info(cluster, name: str, timeout: float = 5.0):
    """The `Info` of worker `name` (pdserve.v1.worker_pb2.WorkerInfo)."""
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    with cluster.internal_channel(name, as_name="admin") as channel:
        return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=timeout)


def counter(cluster, name: str, key: str) -> float:
    return float(worker_info(cluster, name).counters.get(key, 0.0))


def wait_until(pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `pred` until true; fail after `timeout` s (a hang guard, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout:g} s")


def pool_idle(cluster, name: str) -> bool:
    info = worker_info(cluster, name)
    c = info.counters
    return (
        c["pool_free_blocks"] == c["pool_total_blocks"]
        and info.load.num_reserved == 0
        and c["pool_reservations"] == 0
        and c["pool_held_blocks"] == 0
    )
