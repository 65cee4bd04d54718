"""The emulation column of the evidence table: one arm of one seed on a fresh emulated
cluster, `pdserve up <cluster and router flags> --emulate h100 --model-config llama3-8b
--time-scale X` (every real process; only the forward pass is a timed cost model), fed the
same requests as its simulated twin (same prompts, lengths, arrival times), measured with
the same metrics in modelled time (arrivals stretched by X, every time divided by X: the
`bench serve --clock-scale` path).

Prompt lengths match exactly: a text prompt (the length workload) is tokenized here with the
router's own `ModelInfo.encode` on the tokenizer the emulated cluster loads, and the
simulated twin runs those ids; the cluster gets the text (its length predictor reads it)
and tokenizes it to the same ids. The workers' counters (preemptions, the emulated step
lag) are read before and after the load: the differences are this run's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.evidence.metrics import arm_metrics

EMULATE = ["--emulate", "h100", "--model-config", "llama3-8b"]
WARMUP = 2  # sequential short requests before the load (connections, first steps)


@dataclass
class EmuOptions:
    time_scale: float = 10.0
    tokenizer: str | None = None  # the emulated model's tokenizer dir (default: built-in tiny)
    log_dir: Path = Path("bench-results/evidence_emu")
    ready_timeout_s: float = 600.0
    emulate: tuple[str, ...] = tuple(EMULATE)  # the `up` flags naming the hardware and model


def tokenizer_dir(opt: EmuOptions) -> str:
    """The tokenizer `pdserve up --emulate` gives its router (launcher: --tokenizer, else the
    built-in tiny model's)."""
    if opt.tokenizer:
        return opt.tokenizer
    from pdserve.model.tiny import ensure_builtin_tiny

    return str(ensure_builtin_tiny())


_MODELS: dict[str, Any] = {}


def tokenize_prompts(reqs: list[Any], model_dir: str, max_len: int) -> list[Any]:
    """Text prompts get the ids the emulated router computes for them (its `ModelInfo`):
    the simulated twin then serves prompts of exactly the emulated lengths. A request whose
    prompt + answer would pass `max_len` (the router would refuse it) has its answer cut to
    fit, on both sides. In place."""
    from pdserve.router.frontdoor.model_info import ModelInfo

    if model_dir not in _MODELS:
        _MODELS[model_dir] = ModelInfo.from_dir(model_dir)
    info = _MODELS[model_dir]
    for r in reqs:
        if r.prompt_text and not r.prompt_ids:
            r.prompt_ids = info.encode(r.prompt_text)
            if len(r.prompt_ids) + r.max_tokens > max_len:
                r.max_tokens = max(1, max_len - len(r.prompt_ids))
                r.oracle_tokens = r.max_tokens
    return reqs


def requests_digest(reqs: list[Any]) -> str:
    """What makes two request lists the same workload: per request its index, prompt ids,
    text, max_tokens, oracle length, session and arrival time (to the microsecond)."""
    h = hashlib.sha256()
    for r in sorted(reqs, key=lambda r: r.index):
        key = [r.index, list(r.prompt_ids), r.prompt_text, r.max_tokens, r.oracle_tokens,
               r.session_id, round(r.arrival_s, 6)]  # fmt: skip
        h.update(json.dumps(key).encode())
    return h.hexdigest()[:16]


def up_flags(up: list[str], opt: EmuOptions, log_dir: Path) -> list[str]:
    """The arm's `pdserve up` flags as an emulated cluster."""
    # the launcher converts the router's and workers' timers (heartbeats, queue timeouts and
    # aging, deadlines, flip periods) from modelled to wall seconds (pdserve.emulate.timers)
    emulate = list(opt.emulate)
    if "--emulate" in up and "--emulate" in emulate:  # the arm names its pools' hardware
        k = emulate.index("--emulate")
        del emulate[k : k + 2]
    flags = [*up, *emulate, "--time-scale", f"{opt.time_scale:g}"]
    if opt.tokenizer:
        flags += ["--tokenizer", opt.tokenizer]
    return [*flags, "--log-dir", str(log_dir)]


def _delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], key: str):
    return sum(c.get(key, 0.0) - before.get(w, {}).get(key, 0.0) for w, c in after.items())


def router_flips(log_dir: Path, since: float = 0.0) -> int:
    """Role flips the emulated router completed: its "flip done" log lines (JSON or console),
    in its log and the logs a restart set aside (`router.<ms>.log`), written since `since`
    (time.time()): a log set aside by an earlier run in the same directory is not counted."""
    paths = [p for p in sorted(log_dir.glob("router*.log")) if p.stat().st_mtime >= since]
    return sum(p.read_text(errors="replace").count("flip done") for p in paths)


def emulated_arm(
    up: list[str],
    reqs: list[Any],
    slo: Any,
    opt: EmuOptions,
    name: str,
    metrics: Callable[[list[Any], list[Any], Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run `reqs` on a fresh emulated cluster of `up`; the metrics of `evidence.arm_metrics`
    (modelled time; or of `metrics(records, reqs, slo)`) + preemptions, the step lag and the
    client's send lag."""
    from pdserve.bench.cluster import UpProcess
    from pdserve.bench.lengths import worker_counters
    from pdserve.bench.loadgen import open_client, run_load
    from pdserve.bench.modelled_time import stretch_arrivals, to_modelled
    from pdserve.bench.serve import _warmup
    from pdserve.workload.requests import TOKEN_LO

    scale = opt.time_scale
    log_dir = opt.log_dir / name
    flags = up_flags(up, opt, log_dir)
    tls = str(log_dir / "certs")
    # 16-token prompts that no run shares (no prefix-cache hit), 4 tokens out
    warm = [replace(reqs[0], index=-1 - i, prompt_ids=[TOKEN_LO + 7 + 31 * i + k for k in
                                                      range(16)], prompt_text=None,
                    max_tokens=4, arrival_s=0.0, oracle_tokens=4) for i in range(WARMUP)]  # fmt: skip

    async def load() -> tuple[list[Any], float]:
        async with open_client(addr) as client:
            return await run_load(client, stretch_arrivals(reqs, scale), progress=False)

    t0, started_at = time.perf_counter(), time.time()
    with UpProcess(flags, port=0, ready_timeout_s=opt.ready_timeout_s,
                   log_path=opt.log_dir / f"{name}_up.log") as addr:  # fmt: skip
        started = time.perf_counter() - t0
        asyncio.run(_warmup(addr, warm, 0.0))
        _, before = asyncio.run(worker_counters(addr, tls_dir=tls))
        records, _ = to_modelled(*asyncio.run(load()), scale)
        status, after = asyncio.run(worker_counters(addr, tls_dir=tls))
    out = (metrics or arm_metrics)(records, reqs, slo)
    modelled = _delta(before, after, "emulate_modelled_s")
    n_in = {r.index: len(r.prompt_ids) for r in reqs}
    out.update(
        preemptions=_delta(before, after, "engine_num_preemptions"),
        flips=router_flips(log_dir, since=started_at),
        tau=status.predictor_kendall_tau if status.predictor_observed else None,
        step_lag=_delta(before, after, "emulate_lag_s") / modelled if modelled else None,
        # modelled time a busy engine lost between steps, per modelled second stepped
        step_gap=_delta(before, after, "emulate_gap_s") / modelled if modelled else None,
        send_lag_ms_max=max((r.send_s - r.arrival_s) * 1e3 for r in records),
        prompt_tokens_differ=sum(1 for r in records if r.ok and r.n_in != n_in[r.index]),
        workers_read=len(after),
        # each worker's KV blocks: the hardware its pool emulates (`--emulate ROLE=HW`)
        kv_blocks={i.instance_id: i.load["total_blocks"] for i in status.instances},
        wall_s=time.perf_counter() - t0,
        start_s=started,
    )
    return out
