"""`pdserve profile`: measure what the simulator charges, from the real engine and transport.

- Engine steps: a real `LLMEngine` (the checkpoint, dtype and thread count the workers use)
  runs prefill-only batches (prompt lengths x batch sizes), chunked prefills over a cached or
  earlier-chunk context, decode batches (batch size x context) and mixed steps (decodes + a
  prefill chunk). Each `step()` is timed with the scheduler's plan for that step, and
  `StepCost.fit` fits the linear cost model the simulator uses.
- KV transfer: `bench.transfer.run_bench` (UCX between two processes, serial messages) by size;
  `LinkCost.fit` gives latency + bytes / bandwidth.
- kvstore: a real kvstore process; `KVStoreClient.put` (publish) and `fetch` by size.
- Router overhead: a unary gRPC round trip on 127.0.0.1 (the kvstore's Lookup) x 2 hops
  (client -> router -> worker) + the placement decision (`PrefixAware` over a `Registry`).
- Machine limits: `pdserve.bench.limits` when present (see `limits_call_site`).
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.costmodel.costs import CostModel, LinkCost, StepCost, knots_of
from pdserve.sim.engine_steps import on_engine_thread, timed_steps
from pdserve.sim.profile_pd import fit_served_prefill, monotone_points, roles_of
from pdserve.sim.served_probe import served_probe
from pdserve.sim.served_steps import (
    mean_decode_step_s,
    read_step_counters,
    read_step_counters_async,
    serving_work_per_step,
)

MIB = 1 << 20


# ---------------------------------------------------------------------------- engine steps
def device_tick(tick: Callable[[], float], device: str) -> Callable[[], float]:
    """`tick` that first waits for `device`'s queued work: a cuda step returns before its
    kernels end unless something reads their result (a chunk that samples nothing)."""
    if not device.startswith("cuda"):
        return tick
    import torch

    def synced() -> float:
        torch.cuda.synchronize()
        return tick()

    return synced


def sample_long_contexts(
    engine: Any,
    add: Callable[[int, int], None],
    samples: list[dict[str, Any]],
    tick: Callable[[], float],
    quick: bool,
    budget: int,
) -> None:
    """The steps long prompts make (code completion, long documents), which the short shapes
    only reach by extrapolation: decodes at 2,048 tokens of context (1 and 4 sequences; and
    3,072 unless quick), and a 2,048-token prompt whose chunks start at 0 .. 1,536 beside
    decodes of ~1,024 tokens of context (2 and 6 of them). Skipped past the model's context."""
    ctxs = (2048,) if quick else (2048, 3072)
    for ctx in (c for c in ctxs if c + 10 <= engine.max_model_len):
        for b in (1, 4):
            for _ in range(b):
                add(ctx, 9)
            timed_steps(engine, samples, "decode", tick=tick)
    if 2048 + 2 > engine.max_model_len:
        return
    for b in (2, 6):
        for _ in range(b):
            add(1024, 48)  # long enough to decode through every chunk of the prompt below
        for _ in range(-(-b * 1024 // budget) + 1):  # their prompts (not recorded), a decode
            engine.step()
        add(2048, 1)
        timed_steps(engine, samples, "mixed", tick=tick)


def profile_engine(
    model_dir: str,
    dtype: str,
    threads: int,
    quick: bool = True,
    max_num_batched_tokens: int = 512,
    seed: int = 0,
    tick: Callable[[], float] = time.perf_counter,
    device: str = "cpu",
) -> dict[str, Any]:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    if threads > 0:
        torch.set_num_threads(threads)
    tick = device_tick(tick, device)
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=64,
            enable_prefix_caching=False,  # every prompt computes: steps show their full cost
        )
    )
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    counter = iter(range(1 << 30))

    def add(n: int, out: int) -> None:
        n = min(n, engine.max_model_len - out)  # a short-context model: the longest it takes
        ids = rng.integers(10, vocab, size=n).tolist()
        engine.add_request(
            f"p{next(counter)}",
            ids,
            SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
        )

    samples: list[dict[str, Any]] = []
    add(32, 2)  # warm-up (not recorded)
    timed_steps(engine, [], "warmup")
    prompt_lens = (16, 64, 256, 512) if quick else (16, 32, 64, 128, 256, 384, 512)
    batch_sizes = (1, 4) if quick else (1, 2, 4, 8)
    repeats = 2 if quick else 3
    for _ in range(repeats):
        for n in prompt_lens:  # prefill: one step per batch of prompts (budget permitting)
            for b in batch_sizes:
                if n * b > max_num_batched_tokens:
                    continue
                for _ in range(b):
                    add(n, 1)
                timed_steps(engine, samples, "prefill", tick=tick)
        for n in (1024, 2048) if quick else (1024, 1536, 2048):  # chunked: context grows
            if n > engine.max_model_len - 2:
                continue
            add(n, 1)
            timed_steps(engine, samples, "chunked_prefill", tick=tick)
    ctxs = (64, 512) if quick else (64, 256, 512, 1024)
    decode_bs = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    for ctx in ctxs:  # decode: b sequences of context ~ctx, 8 decode steps each
        for b in decode_bs:
            for _ in range(b):
                add(ctx, 9)
            timed_steps(engine, samples, "decode", tick=tick)
    for b in (4, 16):  # mixed: b decodes, then a prompt joins their steps as a chunk
        for _ in range(b):
            add(128, 24)
        for _ in range(2):
            engine.step()
        add(384, 1)
        timed_steps(engine, samples, "mixed", tick=tick)
    sample_long_contexts(engine, add, samples, tick, quick, max_num_batched_tokens)
    # label each sample by what the step held (the same request list mixes kinds)
    for s in samples:
        kinds = {"decode" if n == 1 else "prefill" for _, n in s["batch"]}
        s["kind"] = "mixed" if len(kinds) == 2 else kinds.pop()
    batches, times = [s["batch"] for s in samples], [s["s"] for s in samples]
    knots = knots_of(batches)  # the token term follows the sampled prompt sizes
    step = StepCost.fit(batches, times, knots)
    spec = engine.spec
    return {
        "step": step,
        "step_floor": StepCost.fit_floor(batches, times, token_knots=knots),
        "samples": samples,
        "kv_bytes_per_token": spec.bytes_per_block // spec.block_size,
        "block_size": spec.block_size,
        "num_blocks_default": engine.num_blocks,
        "max_model_len": engine.max_model_len,
        "model_config": {
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": vocab,
            "dtype": spec.dtype,
        },
        "params": int(sum(p.numel() for p in engine.loaded.model.parameters())),
    }


# ---------------------------------------------------------------------------- transport
def profile_transfer(sizes: list[int], iters: int = 8, repeats: int = 2) -> dict[str, Any]:
    from pdserve.bench.transfer import run_bench

    rows = asyncio.run(run_bench(sizes, iters, 1, repeats))
    pts = [(r.size_bytes, r.size_bytes / (r.serial_gbps * 1e9)) for r in rows]
    link = LinkCost.fit([p[0] for p in pts], [p[1] for p in pts])
    return {"link": link, "samples": [{"bytes": b, "s": s} for b, s in pts]}


def profile_kvstore(block_bytes: int, blocks: list[int], repeats: int = 3) -> dict[str, Any]:
    """Publish (put) and fetch through a real kvstore process, by number of blocks."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from pdserve.kv.hashing import block_hashes
    from pdserve.kv.store_client import KVStoreClient
    from pdserve.kv.transfer import UcxTransport
    from pdserve.rpc.certs import make_dev_pki
    from pdserve.rpc.ready import parse_ready_line
    from pdserve.rpc.tls import TlsFiles, client_credentials, configure_client

    cap = max(64 * MIB, 4 * max(blocks) * block_bytes * (repeats + 1))
    # The kvstore runs as in a cluster: mutual TLS (the default), with a throw-away CA and
    # certificates; this process calls it as a worker. Plaintext is not measured.
    certs = tempfile.TemporaryDirectory(prefix="pdserve-profile-certs-")
    make_dev_pki(certs.name, [("kvstore", "kvstore"), ("worker", "profile")])
    argv = [sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--log-format", "console",
            "--capacity-bytes", str(cap), "--no-insecure", "--tls-dir", certs.name,
            "--tls-name", "kvstore"]  # fmt: skip
    saved_creds = client_credentials()
    errlog = tempfile.TemporaryFile(mode="w+")
    configure_client(TlsFiles.in_dir(certs.name, "profile"))
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=errlog, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        addr = None
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline and addr is None:
            line = proc.stdout.readline()
            if not line:
                break
            info = parse_ready_line(line)
            if info is not None:
                addr = f"127.0.0.1:{info['port']}"
        if addr is None:
            errlog.seek(0)
            tail = errlog.read()[-2000:]
            raise RuntimeError(f"kvstore did not start: {tail}")

        async def go() -> dict[str, Any]:
            transport = await UcxTransport.create()
            client = KVStoreClient(addr, transport, raise_errors=True, rpc_timeout_s=10.0,
                                   transfer_timeout_s=30.0)  # fmt: skip
            put_pts, fetch_pts, rtt = [], [], []
            try:
                salt = 0
                for n in blocks:
                    data = np.random.default_rng(n).integers(0, 256, n * block_bytes, np.uint8)
                    out = np.empty_like(data)
                    best_put = best_fetch = float("inf")
                    for _ in range(repeats):
                        salt += 1
                        hashes = block_hashes(
                            list(range(salt * 100_000, salt * 100_000 + 16 * n)), 16, "profile"
                        )
                        t0 = time.perf_counter()
                        stored = await client.put("profile", hashes, 0, data)
                        best_put = min(best_put, time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        got = await client.fetch("profile", hashes, out)
                        best_fetch = min(best_fetch, time.perf_counter() - t0)
                        if stored != n or got != n:
                            raise RuntimeError(f"kvstore stored {stored}, fetched {got} of {n}")
                    put_pts.append((n * block_bytes, best_put))
                    fetch_pts.append((n * block_bytes, best_fetch))
                for _ in range(20):
                    t0 = time.perf_counter()
                    await client.lookup("profile", [b"\0" * 16])
                    rtt.append(time.perf_counter() - t0)
            finally:
                await client.close()
                await transport.close()
            return {"put": put_pts, "fetch": fetch_pts, "rpc_rtt_s": float(np.median(rtt))}

        res = asyncio.run(go())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        _restore_client_credentials(saved_creds)
        errlog.close()
        certs.cleanup()
    return {
        "publish": LinkCost.fit([b for b, _ in res["put"]], [s for _, s in res["put"]]),
        "fetch": LinkCost.fit([b for b, _ in res["fetch"]], [s for _, s in res["fetch"]]),
        "rpc_rtt_s": res["rpc_rtt_s"],
        "samples": {"put": res["put"], "fetch": res["fetch"]},
    }


def _restore_client_credentials(creds: Any) -> None:
    from pdserve.rpc import tls

    tls._client_credentials = creds  # configure_client takes files, not credentials


def profile_router_decision(n_instances: int = 2, iters: int = 2000) -> float:
    """Seconds per placement decision (PrefixAware over a Registry, 256-token prompt)."""
    from pdserve.kv.hashing import block_hashes
    from pdserve.router.cluster.registry import ROLE_COLOCATED, Registry
    from pdserve.router.scheduling.factory import make_policy
    from pdserve.router.scheduling.policies import RouteRequest

    reg = Registry()
    for i in range(n_instances):
        reg.register(f"w{i}", f"h:{i}", ROLE_COLOCATED, "fp", 16)
    policy = make_policy("prefix_aware", session_affinity=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 16000, 256).tolist() for _ in range(64)]
    t0 = time.perf_counter()
    for k in range(iters):
        route = RouteRequest(f"r{k}", prompts[k % 64], hasher=lambda t, b: block_hashes(t, b, "fp"))
        inst = policy.pick_prefill(route, reg.candidates(ROLE_COLOCATED))
        policy.on_routed(route, inst, None)
    return (time.perf_counter() - t0) / iters


# ---------------------------------------------------------------------------- serving
def profile_serving(
    model_dir: str,
    dtype: str,
    threads: int,
    step: StepCost,
    batches: tuple[int, ...] = (1, 2, 4, 8, 16),
    prompt_len: int = 64,
    max_tokens: int = 48,
    prompt_lens: tuple[int, ...] = (8, 32, 128, 256),
    prompt_repeats: int = 4,
    max_model_len: int | None = None,
    device: str = "cpu",
    budget: int = 512,
) -> dict[str, Any]:
    """The serving stack's costs on top of the engine, on a real colocated worker behind a
    real router (`Cluster`, mutual TLS):
    - per streamed token: B concurrent greedy streams; served TPOT minus the engine-only
      step of B decodes (the fitted `step`) x the machine's speed in the same minutes (the
      worker's own steps, `served_steps.serving_work_per_step`) at each B
      (`CostModel.stream_points`, interpolated between them), and divided by B, fitted over B
      by least squares through 0: seconds per sampled sequence per step
      (`CostModel.stream_token_s`, the figure to quote);
    - per prompt: single prompts of `prompt_lens` tokens one at a time; the worker's prefill
      stage minus the worker's own step of that prompt (its step counters; the engine-only
      step where it has none), fitted as a + b * tokens, both >= 0 (`fit_served_prefill`):
      `prefill_chunk_s`, `prefill_token_s`;
    - the request path: client TTFT minus the worker's prefill stage of those prompts, the
      median (`router_overhead_s`: the router, the gRPC hops and the token's way back)."""
    from pdserve.client import AsyncClient
    from pdserve.launcher import Cluster, ClusterConfig

    cluster = Cluster(ClusterConfig(
        model=model_dir, mode="colocated", colocated=1, port=0,
        worker_args=["--threads", str(threads), "--dtype", dtype, "--device", device],
    ))  # fmt: skip
    if max_model_len:  # a prompt and its 2 tokens must fit the context
        prompt_lens = tuple(min(n, max_model_len - 2) for n in prompt_lens)
    cluster.start(timeout=300.0)
    rng = np.random.default_rng(1)
    try:

        async def streams(b: int) -> list[float]:
            async with AsyncClient(cluster.addr, timeout=300.0) as client:
                rs = await asyncio.gather(*(
                    client.generate(token_ids=rng.integers(10, 200, prompt_len).tolist(),
                                    max_tokens=max_tokens, ignore_eos=True)
                    for _ in range(b)
                ))  # fmt: skip
            return [r.tpot_ms / 1e3 for r in rs]

        async def prompts() -> list[dict[str, float]]:
            out = []
            async with AsyncClient(cluster.addr, timeout=300.0) as client:
                for i in range(prompt_repeats * len(prompt_lens)):
                    n = prompt_lens[i % len(prompt_lens)]
                    # one token: the worker steps this prompt's step and nothing else
                    before = await read_step_counters_async(cluster, "colocated0")
                    r = await client.generate(token_ids=rng.integers(10, 200, n).tolist(),
                                              max_tokens=1, ignore_eos=True)  # fmt: skip
                    after = await read_step_counters_async(cluster, "colocated0")
                    served_s = (r.usage.stages if r.usage else {}).get("prefill_ms", 0.0) / 1e3
                    window = after.since(before) if before and after else None
                    out.append({"tokens": n, "prefill_s": served_s, "ttft_s": r.ttft_ms / 1e3,
                                "engine_step_s": step.step_s([(0, n)]),
                                "served_step_s": window.seconds if window else None})  # fmt: skip
                    await asyncio.sleep(0.05)  # one at a time: nothing queues
            return out

        asyncio.run(streams(2))  # warm-up
        points = []
        for b in batches:
            before = read_step_counters(cluster, "colocated0")
            tpot = float(np.median(asyncio.run(streams(b))))
            after = read_step_counters(cluster, "colocated0")
            ctx = prompt_len + max_tokens // 2
            engine_s = step.step_s([(ctx, 1)] * b)
            n_pre, pre_s = prompt_steps(step, b, prompt_len, budget)
            window = after.since(before) if before and after else None
            points.append({"streams": b, "tpot_s": tpot, "engine_step_s": engine_s,
                           "served_step_s": mean_decode_step_s(window, n_pre, pre_s)})  # fmt: skip
        prefills = asyncio.run(prompts())
        reference = asyncio.run(served_probe(cluster.addr))  # `sim validate --probe`'s base
    finally:
        cluster.stop()
    work = serving_work_per_step(points)
    x = np.array(sorted(work), dtype=float)
    y = np.array([work[int(b)] for b in x])
    per_stream = max(0.0, float(x @ y / (x @ x)))
    chunk_s, token_s = fit_served_prefill(prefills)
    path_s = float(np.median([p["ttft_s"] - p["prefill_s"] for p in prefills]))
    return {
        "stream_token_s": per_stream,
        # per stream count, never negative nor falling: `CostModel.stream_points`
        "stream_points": monotone_points(work),
        "samples": points,
        "prefill_chunk_s": chunk_s,
        "prefill_token_s": token_s,
        "prefill_samples": prefills,
        "path_overhead_s": max(0.0, path_s),
        "served_probe": reference,
    }


def prompt_steps(step: StepCost, b: int, prompt_len: int, budget: int) -> tuple[int, float]:
    """(steps, engine-only seconds) of b concurrent prompts of `prompt_len` tokens, as many
    to a step as `budget` takes."""
    per = max(1, budget // prompt_len)
    groups = [min(per, b - i) for i in range(0, b, per)]
    return len(groups), sum(step.step_s([(0, prompt_len)] * g) for g in groups)


# ---------------------------------------------------------------------------- limits
def limits_call_site(dtype: str, threads: int) -> dict[str, Any] | None:
    """Machine limits (memory read bandwidth, GEMM peak in `dtype`) from
    `pdserve.bench.limits.measure_limits(dtype=, threads=)` (returns {"bandwidth_bytes_s",
    "gemm_flops_s", ...}), or None where that module is absent; `pdserve profile` records the
    limits and the engine's achieved fractions in the same run."""
    try:
        from pdserve.bench import limits  # type: ignore[attr-defined]
    except ImportError:
        return None
    fn: Callable[..., dict[str, Any]] | None = getattr(limits, "measure_limits", None)
    if fn is None:
        return None
    return fn(dtype=dtype, threads=threads)


def achieved_fractions(eng: dict[str, Any], limits: dict[str, Any] | None) -> dict[str, Any] | None:
    """Engine achieved fraction of the machine limits, from the fitted *floor* step model:
    decode weight+KV bytes/s over memory bandwidth (16 sequences at context 512), prefill
    FLOP/s over GEMM peak (512 tokens, 2 x params FLOP per token; attention not counted)."""
    if not limits:
        return None
    step: StepCost = eng.get("step_floor") or eng["step"]
    itemsize = 2 if "16" in eng["model_config"]["dtype"] else 4
    weight_bytes = eng["params"] * itemsize
    out: dict[str, Any] = {}
    bw = limits.get("bandwidth_bytes_s")
    if bw:
        t = step.step_s([(512, 1)] * 16)
        moved = weight_bytes + 16 * 513 * eng["kv_bytes_per_token"]
        out["decode_bandwidth_fraction"] = moved / t / bw
    peak = limits.get("gemm_flops_s")
    if peak:
        t = step.step_s([(0, 512)])
        out["prefill_gemm_fraction"] = 2 * eng["params"] * 512 / t / peak
    return out


# ---------------------------------------------------------------------------- all
def run_profile(
    model_dir: str,
    dtype: str = "float32",
    threads: int = 1,
    quick: bool = True,
    skip_transport: bool = False,
    log: Callable[[str], None] = print,
    device: str = "cpu",
) -> dict[str, Any]:
    started = time.perf_counter()
    probe = probed_before = None
    if device == "cpu":  # the probe's steps before and after the engine's: the machine then
        log("probing the machine's speed (the baseline of `sim validate --probe`) ...")
        probed_before = probe_at_profile(model_dir, dtype)
    log("profiling engine steps ...")
    eng = on_engine_thread(profile_engine, model_dir, dtype, threads, quick, device=device)
    if probed_before is not None:
        probe = probe_at_profile(model_dir, dtype, eng["step"], eng["step_floor"],
                                 earlier=probed_before["samples"])  # fmt: skip
        log(f"  probe x{probe['prefill_factor']:.3f} prompt steps, "
            f"x{probe['decode_factor']:.3f} decode steps against the floor fit")  # fmt: skip
    log(
        f"  {len(eng['samples'])} steps; fit rel. RMS error {eng['step'].fit_rel_rmse:.1%} "
        f"(floor fit {eng['step_floor'].fit_rel_rmse:.1%} on its samples)"
    )
    block_bytes = eng["kv_bytes_per_token"] * eng["block_size"]
    costs = CostModel(step=eng["step"], kv_bytes_per_token=eng["kv_bytes_per_token"],
                      name=f"{Path(model_dir).name}/{dtype}/{threads}t")  # fmt: skip
    transfer = kvstore = None
    if not skip_transport:
        log("profiling KV transfer (UCX) ...")
        transfer = profile_transfer([block_bytes * n for n in (1, 8, 32, 128)])
        costs.transfer = transfer["link"]
        log("profiling kvstore publish/fetch ...")
        kvstore = profile_kvstore(block_bytes, [1, 8, 32])
        costs.kvstore_fetch, costs.kvstore_publish = kvstore["fetch"], kvstore["publish"]
    serving = None
    if not skip_transport:
        log("profiling the serving stack (router + worker, streamed tokens) ...")
        serving = profile_serving(
            model_dir, dtype, threads, eng["step"], max_model_len=eng["max_model_len"],
            device=device,
        )  # fmt: skip
        costs.stream_token_s = serving["stream_token_s"]
        costs.stream_points = tuple(serving["stream_points"])
        costs.prefill_chunk_s = serving["prefill_chunk_s"]
        costs.prefill_token_s = serving["prefill_token_s"]
        log(f"  {costs.stream_token_s * 1e3:.3f} ms per streamed sequence per step; a prompt "
            f"{costs.prefill_chunk_s * 1e3:.2f} ms + {costs.prefill_token_s * 1e6:.1f} us per "
            f"token over its own step; request path {serving['path_overhead_s'] * 1e3:.2f} ms")  # fmt: skip
    pd = None
    if not skip_transport:
        from pdserve.sim.profile_pd import profile_pd

        log("profiling a served 1P1D (each role with its neighbour idle and busy) ...")
        pd = profile_pd(
            model_dir, dtype, threads, eng["step"], device, max_model_len=eng["max_model_len"],
            colocated_prompts=serving["prefill_samples"] if serving else None,
            colocated_extra=(costs.prefill_chunk_s, costs.prefill_token_s),
        )  # fmt: skip
        log(f"  a busy neighbour slows the prefill x{pd['prefill_factor']:.3f}, the decode "
            f"x{pd['decode_factor']:.3f} (raw {pd['raw_factors']['prefill']:.3f}, "
            f"{pd['raw_factors']['decode']:.3f})")  # fmt: skip
        log(f"  a disaggregated prompt: request path {pd['path_overhead_s'] * 1e3:.2f} ms; "
            f"{pd['prefill_chunk_s'] * 1e3:.2f} ms + {pd['prefill_token_s'] * 1e6:.1f} us per "
            "token over its own step")  # fmt: skip
        # the caches' state is the machine's: a colocated worker's prompt after a pause pays
        # it too (the 1P1D prefill, which idles between prompts, is where it is measured)
        costs.cold_prompt_s = pd["cold_prompt_s"]
        log(f"  a prompt step after a pause: +{pd['cold_prompt_s'] * 1e3:.2f} ms over one "
            "back to back")  # fmt: skip
    decision_s = profile_router_decision()
    rtt = kvstore["rpc_rtt_s"] if kvstore else 0.0
    # the measured request path of a served prompt when there is one, else its estimate
    # from two gRPC round trips and the router's decision
    costs.router_overhead_s = serving["path_overhead_s"] if serving else 2 * rtt + decision_s
    limits = limits_call_site(dtype, threads)
    return {
        "version": 1,
        "model": str(model_dir),
        "dtype": dtype,
        "threads": threads,
        "device": device,
        "machine": {
            "node": platform.node(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "device_name": device_name(device),
        },
        "costs": costs.to_json(),
        "engine": {k: v for k, v in eng.items() if k not in ("step", "step_floor")},
        "step_floor": asdict(eng["step_floor"]),
        "transfer": None if transfer is None else {"samples": transfer["samples"]},
        "kvstore": None
        if kvstore is None
        else {"samples": kvstore["samples"], "rpc_rtt_s": kvstore["rpc_rtt_s"]},
        "router": {"decision_s": decision_s, "rpc_rtt_s": rtt},
        "serving": serving,
        "served_1p1d": pd,
        "roles": roles_of(pd) if pd else None,
        "probe": probe,
        "limits": limits,
        "achieved": achieved_fractions(eng, limits),
        "profile_s": time.perf_counter() - started,
    }


def probe_at_profile(
    model_dir: str,
    dtype: str,
    step: StepCost | None = None,
    floor: StepCost | None = None,
    earlier: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`sim validate --probe`'s probe, run now: without fits, its steps only; with them, the
    ratios the machine gives against this profile's floor fit over its steps and the
    `earlier` ones (the probe's steps before the engine's), so the reading brackets the
    minute the fit describes. A later probe's factor is taken relative to it
    (`cli.sim.calibrated_costs`), so the floor fit's own error at the probe's shapes (the
    probe read 0.80-0.90 on a quiet machine) cancels."""
    import tempfile

    from pdserve.sim.probe import probe_factors, probe_subprocess

    if step is None or floor is None:
        return probe_subprocess(model_dir, None, dtype)
    fits = {"costs": {"step": asdict(step)}, "step_floor": asdict(floor)}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(fits, f)
        f.flush()
        now = probe_subprocess(model_dir, f.name, dtype)
    if not earlier:
        return now
    both = probe_factors(earlier + now["samples"], floor)
    after = {k: v for k, v in now.items() if k != "samples"}
    return both | {"samples": earlier + now["samples"], "after_steps": after}


def device_name(device: str) -> str:
    """The accelerator's name ('NVIDIA H100 80GB HBM3'), or 'cpu'."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(torch.device(device)))


def write_profile(data: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str))
    return out
