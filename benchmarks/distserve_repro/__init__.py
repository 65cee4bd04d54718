"""DistServe's chatbot result reproduced: its simulator and ours, the same request list and
the same coefficients, three arms, per-GPU goodput at 90 % joint attainment; then what its
simulator does not model (chunked prefill, the KV transfer).

    python -m benchmarks.distserve_repro [--json] [--extensions]
    python -m benchmarks.distserve_repro --run-theirs CHECKOUT --their-python PY   # its simulator

Setup (the paper's chatbot experiment, OSDI'24 Figure 8): OPT-13B on A100-80GB, ShareGPT-like
lengths (workload.py), TTFT <= 0.25 s and TPOT <= 0.1 s, goodput = the highest per-GPU rate
at which 90 % of requests meet both. Both simulators charge DistServe's fitted step latencies
(costmodel/fitted/distserve-opt-13b.json, costmodel/distserve.py) and schedule as DistServe's
does: no chunking, prefill priority, a prefill step takes every waiting prompt up to the
instance's KV tokens, a decode step every running sequence; KV moves for free. TTFT ends when
the prefill step ends; TPOT = decode time / decode steps (our requests serve output_len + 1
tokens, token 0 coming from the prefill). Their curves are stored in
benchmarks/published/distserve_repro.json with the commit and the commands that produced them.
"""
