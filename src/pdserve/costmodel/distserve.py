"""DistServe's fitted step-latency form, charged from its published coefficients.

DistServe (OSDI'24) fits, per model, GPU, tensor-parallel degree and engine (its own, and the
vLLM baseline it compares against), in milliseconds:
    prefill step: a + b * sum(l) + c * sum(l^2)          over the step's prompts of length l
    decode step:  a + b * sum(context + 1) + c * batch   (one coefficient set below
                                                          `large_batch_from` sequences, one from there)
and its simulator adds `per_step_ms + per_context_token_ms * context tokens` to every step.
`fitted/distserve-opt-13b.json` holds the coefficients with their source (repository, commit,
files). Two extensions cover what DistServe's simulator does not schedule:
- a prefill chunk over a cached prefix (chunked prefill): its sum(l^2) term becomes
  n^2 + 2 n s for a chunk of n tokens after s cached ones (the same query x key pairs, x 2,
  that a whole prompt's l^2 counts);
- a mixed step (prefill chunks + decodes): the prefill form over all its tokens (a decode is
  one token) plus the decode form's context term b * sum(context + 1) for its decodes.
An entry of one new token is a decode. Steps whose entries are all decodes are charged the
decode form exactly as DistServe's simulator charges them; whole-prompt prefill steps too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pdserve.costmodel.costs import CostModel, LinkCost
from pdserve.costmodel.hardware import NETWORKS
from pdserve.costmodel.shapes import load_model_config

FITTED_DIR = Path(__file__).parent / "fitted"
ENGINES = ("distserve", "vllm")


@dataclass(frozen=True)
class DistServeStep:
    """One engine's coefficients (ms) at one tensor-parallel degree."""

    prefill: tuple[float, float, float]
    decode_small: tuple[float, float, float]
    decode_large: tuple[float, float, float]
    large_batch_from: int = 95
    per_step_ms: float = 2.0
    per_context_token_ms: float = 1e-4
    # the simulator hands this step model the plan's (start, new) entries, not plan_features
    needs_batch: ClassVar[bool] = True

    def _decode(self, n: int) -> tuple[float, float, float]:
        return self.decode_small if n < self.large_batch_from else self.decode_large

    def step_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        dec_ctx = sum(s + 1 for s, n in batch if n == 1)  # each decode's context + 1
        n_dec = sum(1 for _, n in batch if n == 1)
        pre = [(s, n) for s, n in batch if n > 1]
        context = sum(s + n for s, n in batch)
        if pre:
            a, b, c = self.prefill
            tokens = sum(n for _, n in pre) + n_dec
            squares = sum(n * n + 2 * n * s for s, n in pre)
            ms = a + b * tokens + c * squares + self._decode(n_dec)[1] * dec_ctx
        else:
            a, b, c = self._decode(n_dec)
            ms = a + b * dec_ctx + c * n_dec
        return (ms + self.per_step_ms + self.per_context_token_ms * context) / 1e3

    def features_s(self, features: tuple[float, float, float, float, float]) -> float:
        """From `plan_features` alone: exact for an all-decode step (new = sequences) and a
        whole-prompt prefill step (sum(l^2) = 2 * pairs - new); a mixed step is taken as
        prefill (`step_s` with the entries is exact)."""
        _, new, seqs, ctx, pairs = features
        if new <= seqs:  # every entry one token: decodes, ctx = sum(context + 1)
            a, b, c = self._decode(int(seqs))
            ms = a + b * ctx + c * seqs
        else:
            a, b, c = self.prefill
            ms = a + b * new + c * (2.0 * pairs - new)
        return (ms + self.per_step_ms + self.per_context_token_ms * ctx) / 1e3


def load_distserve(spec: str) -> dict[str, Any]:
    """A coefficient file: a path, or a shipped name ('opt-13b' -> fitted/distserve-opt-13b.json)."""
    path = Path(spec)
    if not path.is_file():
        shipped = FITTED_DIR / f"distserve-{spec.lower()}.json"
        if not shipped.is_file():
            known = sorted(
                p.stem.removeprefix("distserve-") for p in FITTED_DIR.glob("distserve-*.json")
            )
            raise ValueError(f"no DistServe coefficients {spec!r}: a file or one of {known}")
        path = shipped
    data = json.loads(path.read_text())
    for key in ("engines", "model", "gpu", "source", "max_num_tokens"):
        if key not in data:
            raise ValueError(f"{path}: not a DistServe coefficient file (no {key!r})")
    return data


def distserve_step(data: dict[str, Any], engine: str = "distserve", tp: int = 1) -> DistServeStep:
    if engine not in data["engines"]:
        raise ValueError(f"engine {engine!r}: the file has {sorted(data['engines'])}")
    fits = data["engines"][engine]
    if str(tp) not in fits:
        raise ValueError(f"{engine} at tensor parallel {tp}: the file has TP {sorted(fits)}")
    e = fits[str(tp)]
    over = data.get("step_overhead") or {}
    return DistServeStep(
        tuple(e["prefill"]), tuple(e["decode_small_batch"]), tuple(e["decode_large_batch"]),
        int(e.get("large_batch_from", 95)), float(over.get("per_step_ms", 0.0)),
        float(over.get("per_context_token_ms", 0.0)),
    )  # fmt: skip


def distserve_costs(
    spec: str, engine: str = "distserve", tp: int = 1, network: str | None = None
) -> CostModel:
    """An instance's costs from DistServe's coefficients. KV moves for free, as in
    DistServe's simulator, unless `network` names a link (`costmodel.hardware.NETWORKS`)."""
    data = load_distserve(spec)
    shape = load_model_config(data["model"])
    kv = shape.kv_bytes_per_token(2)
    tokens = data["max_num_tokens"].get(str(tp))
    if tokens is None:
        raise ValueError(f"no KV capacity for tensor parallel {tp} in {spec!r}")
    if network is not None and network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; known: {sorted(NETWORKS)}")
    link = NETWORKS[network] if network else None
    return CostModel(
        step=distserve_step(data, engine, tp),  # type: ignore[arg-type]  # step_s, features_s
        transfer=LinkCost(link.latency_s, link.bandwidth_GBps * 1e9 * tp) if link else LinkCost(),
        kv_bytes_per_token=kv,
        name=f"distserve:{data['model']}@{data['gpu']}x{tp}/{engine}",
        kv_capacity_bytes=int(tokens) * kv,
        devices=tp,
    )


def parse_cost_model(spec: str) -> tuple[str, str]:
    """'distserve:FILE_OR_NAME[:ENGINE]' -> (file or name, engine)."""
    kind, _, rest = spec.partition(":")
    if kind != "distserve" or not rest:
        raise ValueError(f"cost model {spec!r}: expected distserve:FILE_OR_NAME[:ENGINE]")
    head, sep, tail = rest.rpartition(":")
    if sep and tail in ENGINES:
        return head, tail
    return rest, "distserve"
