"""Helpers of the KV-reuse end-to-end tests (test_kvreuse_*.py): tiny checkpoints with room for
multi-turn chats, clusters of real processes, the in-process engine as reference, and a sync
view of the kvstore (Stats, Lookup, RSS). Every wait is bounded (a hang guard, not a timing
claim)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_SIZE = 16
VOCAB = 512
MAX_POS = 1024  # room for a 6-turn chat (the serving tests' model stops at 256)
WORKER_ARGS = ["--num-blocks", "128", "--max-num-batched-tokens", "512"]


def make_model(root: Path, seed: int = 0) -> Path:
    """A tiny llama (hidden 64, 2 layers, vocab 512) with tokenizer; `seed` picks the weights."""
    from pdserve.model.tiny import TinySpec, make_tiny

    return Path(
        make_tiny(root / f"llama-seed{seed}", TinySpec(seed=seed, vocab=VOCAB, max_pos=MAX_POS))
    )


def make_engine(model_dir: Path, num_blocks: int = 256):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir), dtype="float32", num_blocks=num_blocks, block_size=BLOCK_SIZE
        )
    )


def reference(engine, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy, ignore_eos tokens of the in-process engine."""
    from pdserve.engine.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([list(prompt)], params)[0]


def start_cluster(model_dir: Path, **kw):
    """A started `Cluster` on any free port (the caller stops it)."""
    from pdserve.launcher import Cluster, ClusterConfig

    kw.setdefault("worker_args", list(WORKER_ARGS))
    cluster = Cluster(ClusterConfig(model=str(model_dir), port=0, **kw))
    cluster.start(timeout=180.0)
    return cluster


def full_blocks_tokens(n_tokens: int) -> int:
    """Tokens in the whole blocks of `n_tokens`."""
    return n_tokens // BLOCK_SIZE * BLOCK_SIZE


def reuse_floor(prev_prompt: int, prev_answer: int) -> int:
    """The acceptance bar of a turn's cached tokens: 90% of the previous turn's prompt +
    answer, rounded down to whole blocks."""
    return full_blocks_tokens(int(0.9 * (prev_prompt + prev_answer)))


def written_back_blocks(n_tokens: int) -> int:
    """Blocks of a finished conversation of `n_tokens` that have KV: the last sampled token
    was never fed through the model, so the write-back covers `n_tokens - 1` tokens."""
    return (n_tokens - 1) // BLOCK_SIZE


# ------------------------------------------------------------------ the kvstore, synchronously
class StoreProbe:
    """Stats / Lookup against a cluster's kvstore (mutual TLS unless it runs --insecure)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.addr = f"127.0.0.1:{cluster.kvstore_port}"

    def _call(self, method: str, request, timeout: float = 5.0):
        from pdserve.v1 import kvstore_pb2_grpc

        # Lookup is a worker's call: the probe uses the cluster's shared worker certificate
        with self.cluster.internal_channel(self.addr, as_name="worker") as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            return getattr(stub, method)(request, timeout=timeout)

    def stats(self):
        from pdserve.v1 import kvstore_pb2

        return self._call("Stats", kvstore_pb2.StatsRequest())

    def lookup(self, namespace: str, hashes: Sequence[bytes], window_blocks: int = 0) -> int:
        """The store's hit; `window_blocks` > 0: a layered model's (window parts included)."""
        from pdserve.v1 import kvstore_pb2

        req = kvstore_pb2.LookupRequest(
            namespace=namespace, block_hashes=list(hashes), window_blocks=window_blocks
        )
        return int(self._call("Lookup", req).num_hit_blocks)


def block_hashes_of(namespace: str, token_ids: Sequence[int]) -> list[bytes]:
    from pdserve.kv.hashing import block_hashes

    return block_hashes(list(token_ids), BLOCK_SIZE, namespace)


def wait_written_back(
    probe: StoreProbe,
    namespace: str,
    token_ids: Sequence[int],
    timeout: float = 30.0,
    window_blocks: int = 0,
) -> None:
    """Poll until the store holds the whole-block KV of a finished conversation (the decode
    worker writes it back in the background after the answer was sent)."""
    hashes = block_hashes_of(namespace, token_ids)[: written_back_blocks(len(token_ids))]
    wait_until(
        lambda: probe.lookup(namespace, hashes, window_blocks) >= len(hashes),
        timeout,
        f"write-back of {len(hashes)} blocks",
    )


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_until(pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout:g} s")


# ------------------------------------------------------------------ conversations
@dataclass
class Turn:
    prompt: list[int]
    answer: list[int]
    cached_tokens: int
    kvstore_tokens: int
    prefill_instance: str


@dataclass
class Conversation:
    """A token-id chat: each turn's prompt = the previous prompt + its answer + new user
    tokens (drawn from a seeded RNG, so two runs of one seed ask the same questions)."""

    seed: int
    first_tokens: int = 40
    user_tokens: int = 24
    answer_tokens: int = 16
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def next_prompt(self) -> list[int]:
        n = self.first_tokens if not self.turns else self.user_tokens
        self.history += [self._rng.randint(2, VOCAB - 1) for _ in range(n)]
        return list(self.history)

    def send(self, client, **kw) -> Turn:
        prompt = self.next_prompt()
        res = client.generate(
            token_ids=prompt, max_tokens=self.answer_tokens, temperature=0.0,
            ignore_eos=True, **kw,
        )  # fmt: skip
        stages = res.usage.stages if res.usage else {}
        turn = Turn(
            prompt, list(res.token_ids), res.cached_tokens,
            int(stages.get("kvstore_tokens", 0)),
            res.usage.prefill_instance if res.usage else "",
        )  # fmt: skip
        self.history += turn.answer
        self.turns.append(turn)
        return turn

    @property
    def last(self) -> list[int]:
        """The last turn's prompt + answer."""
        return list(self.history)
