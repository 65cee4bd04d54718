"""Load held on both doors: N concurrent streams through each front door of the default
deployment, with one router and with replicas.

For each `--routers` value a cluster as `pdserve up [--routers R]` runs it (1 prefill, 1
decode, kvstore, mutual TLS, the built-in tiny model; real processes, a real Redis with 2 or
more routers). Then `--streams` concurrent streams of `--max-tokens` tokens (ignore_eos) go
through the OpenAI HTTP API with the `openai` client (spread over every replica's URL), then
the same through the gRPC SDK (`AsyncClient` given every replica's address), no client
retries (`pdserve bench frontdoor --load`, bench/doorload.py). `--idle-wait-s` after the load
every worker's KV pool is read.

Per (routers, door): streams ok, server errors (anything but a 429 or a short stream), 429s
(admission refusals, decided before any work), and the KV blocks held afterwards; the
routers' log lines of failed and cancelled requests. Exit status 0 when every server-error
and blocks count is 0.

    .venv/bin/python -m benchmarks.door_load --streams 2048 --routers 1,2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

from benchmarks.router_kill import blocks_held
from pdserve.bench.doorload import run_load


def _is_429(kind: str) -> bool:
    return kind.startswith("HTTP 429") or kind.startswith("ResourceExhausted")


def router_log_counts(log_dir: Path) -> dict[str, int]:
    """Lines of every router log: requests that failed, and that their client left."""
    out = {"request failed": 0, "request cancelled by the client": 0}
    for path in log_dir.glob("router*.log"):
        for line in path.read_text(errors="replace").splitlines():
            for k in out:
                if f'"{k}"' in line:
                    out[k] += 1
    return out


def one_topology(routers: int, args: argparse.Namespace) -> list[dict]:
    from pdserve.launcher import Cluster, ClusterConfig

    cluster = Cluster(ClusterConfig(routers=routers, kvstore=True, port=0, http_port=0))
    t0 = time.monotonic()
    cluster.start(timeout=600)
    print(f"== {routers} router(s) up in {time.monotonic() - t0:.0f} s; logs {cluster.log_dir}",
          flush=True)  # fmt: skip
    rows = []
    try:
        for door in ("openai", "sdk"):
            (row,) = asyncio.run(
                run_load(
                    streams=args.streams, door=door, addr=",".join(cluster.addrs),
                    http_url=",".join(cluster.http_urls), max_tokens=args.max_tokens,
                    seed=args.seed,
                )
            )  # fmt: skip
            time.sleep(args.idle_wait_s)
            pools = blocks_held(cluster)
            fails = row["failures"]
            row.update(
                routers=routers,
                http_429=sum(n for k, n in fails.items() if _is_429(k)),
                server_errors=sum(n for k, n in fails.items() if not _is_429(k)),
                blocks_held=int(sum(w["not_free"] + w["held"] for w in pools.values())),
                reservations_left=int(sum(w["reservations"] for w in pools.values())),
            )
            rows.append(row)
            print(f"   {door:<7} {row['ok']}/{row['streams']} ok, server errors "
                  f"{row['server_errors']}, 429 {row['http_429']}, blocks held "
                  f"{row['blocks_held']}; wall {row['wall_s']} s, TTFT p99 {row['ttft_p99_s']} s",
                  flush=True)  # fmt: skip
            for kind, n in fails.items():
                print(f"      {n:>5} x {kind}")
        logged = router_log_counts(cluster.log_dir)
        for row in rows:
            row["router_log_counts_both_doors"] = logged
        print(f"   router logs: {logged}")
    finally:
        cluster.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--routers", default="1,2", help="router counts, one cluster each")
    p.add_argument("--idle-wait-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [r for n in args.routers.split(",") for r in one_topology(int(n), args)]
    cmd = shlex.join(sys.argv[1:] if argv is None else argv)
    doc = {"command": f"python -m benchmarks.door_load {cmd}".strip(), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    bad = sum(r["server_errors"] + r["blocks_held"] for r in rows)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
