"""`pdserve profile --model DIR --out FILE.json`: measure the real engine and transport for
the simulator (`pdserve sim`, `pdserve plan`). See pdserve.sim.profile."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile", help="measure engine steps, KV transfer, kvstore and router costs"
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (a pinned worker: 1)")
    p.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")
    p.add_argument("--out", default="results/profile.json")
    p.add_argument("--full", action="store_true", help="more shapes and repeats (slower)")
    p.add_argument(
        "--no-transport", action="store_true", help="engine only (skip UCX, kvstore and serving)"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pdserve.sim.profile import run_profile, write_profile

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    data = run_profile(
        args.model, args.dtype, args.threads, quick=not args.full,
        skip_transport=args.no_transport, log=log, device=args.device,
    )  # fmt: skip
    path = write_profile(data, args.out)
    c = data["costs"]
    st = c["step"]
    knots = st.get("token_knots") or []
    tokens = (
        " then ".join(f"{v * 1e6:.0f} us/token from {k:.0f}"
                      for k, v in zip(knots, st["token_slopes"], strict=True))
        if knots
        else f"{st['per_token_s'] * 1e6:.1f} us/token"
    )  # fmt: skip
    print(
        f"step = {st['base_s'] * 1e3:.2f} ms + {tokens} "
        f"+ {st['per_seq_s'] * 1e6:.1f} us/seq + {st['per_ctx_token_s'] * 1e9:.1f} ns/ctx token "
        f"+ {st['per_attn_s'] * 1e9:.3f} ns/attn pair (fit rel. RMS {st['fit_rel_rmse']:.1%})"
    )
    for k in ("transfer", "kvstore_fetch", "kvstore_publish"):
        link = c[k]
        bw = link["bandwidth_Bps"]
        print(f"{k:<16} {link['latency_s'] * 1e3:.3f} ms + bytes / "
              f"{'inf' if bw is None else f'{bw / 1e9:.2f} GB/s'}")  # fmt: skip
    print(f"router overhead  {c['router_overhead_s'] * 1e3:.3f} ms/request")
    print(f"stream token     {c.get('stream_token_s', 0.0) * 1e3:.3f} ms per streamed sequence "
          "per step")  # fmt: skip
    if c.get("stream_points"):
        print("stream per step  " + ", ".join(f"{y * 1e3:.2f} ms at {x:.0f}"
                                             for x, y in c["stream_points"]))  # fmt: skip
    roles = data.get("roles") or {}
    pre, dec = roles.get("prefill") or {}, roles.get("decode") or {}
    if pre.get("neighbour_points"):
        print("1P1D prefill     x" + ", x".join(f"{y:.3f} beside a decode of {x:.0f} stream(s)"
                                              for x, y in pre["neighbour_points"]))  # fmt: skip
    if dec.get("stream_points"):
        print("1P1D decode      " + ", ".join(f"{y * 1e3:.2f} ms at {x:.0f}"
                                             for x, y in dec["stream_points"])
              + f" per step; Reserve {dec.get('reserve_s', 0.0) * 1e3:.2f} ms")  # fmt: skip
    if c.get("cold_prompt_s"):
        print(f"cold prompt step +{c['cold_prompt_s'] * 1e3:.2f} ms after "
              f"{c.get('cold_after_s', 0.25):.2f} s without a step")  # fmt: skip
    probes = [(name, (data.get(part) or {}).get("served_probe"))
              for name, part in (("colocated", "serving"), ("1P1D", "served_1p1d"))]  # fmt: skip
    if any(p for _, p in probes):
        print("served probe     " + "; ".join(
            f"{name} TTFT {p['ttft_s'] * 1e3:.1f} ms, TPOT {p['tpot_s'] * 1e3:.2f} ms"
            for name, p in probes if p
        ))  # fmt: skip
    print(f"limits           {data['limits'] or 'n/a (pdserve.bench.limits not present)'}")
    print(f"wrote {path} in {data['profile_s']:.0f} s")
    return 0
