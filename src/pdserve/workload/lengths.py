"""The length workload: real prompts with the output length a chosen model really produced
(the length data, `pdserve predictor` format), for measuring scheduling that predicts output
lengths. Each request sends the prompt as text (the router's predictor reads it), with
max_tokens = that model's answer length x `scale` (the tiny CPU model cannot afford real
lengths; say the scale with every result) and ignore_eos, and carries the same number as
`oracle_tokens` (metadata that only a router started with --predictor-oracle reads)."""

from __future__ import annotations

import numpy as np

from pdserve.workload.requests import BenchRequest


def length_requests(
    path: str,
    model: str,
    n: int,
    *,
    split: str = "val",
    scale: float = 0.05,
    seed: int = 0,
    max_prompt_chars: int = 1500,
    max_output: int | None = None,
) -> list[BenchRequest]:
    """`n` (prompt, length) pairs of `model` (its `model_canonical`; "any" = every
    model) from rows of `split` ("" = all), drawn without replacement with `seed`."""
    from pdserve.router.scheduling.predictor.evaluate import read_rows

    rows = [
        r
        for r in read_rows(path)
        if (model == "any" or r.get("model_canonical") == model)
        and (not split or r.get("prompt_split") == split)
        and r.get("prompt")
    ]
    if not rows:
        raise ValueError(f"no rows of model {model!r} (split {split!r}) in {path}")
    rows.sort(key=lambda r: str(r.get("id", "")))
    rng = np.random.default_rng([seed, 5])
    picks = rng.permutation(len(rows))[: min(n, len(rows))]
    reqs = []
    for i, j in enumerate(picks):
        r = rows[int(j)]
        n_out = max(1, round(int(r["response_tokens_cl100k"]) * scale))
        if max_output:
            n_out = min(n_out, max_output)
        text = str(r["prompt"])[:max_prompt_chars]
        reqs.append(BenchRequest(i, [], n_out, prompt_text=text, oracle_tokens=n_out))
    return reqs
