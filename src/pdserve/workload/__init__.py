"""Workloads and their scoring, shared by the benchmarks (pdserve.bench) and the simulator
(pdserve.sim): trace readers, arrival processes, request lists, per-request records and
summaries, SLOs and goodput.

- traces.py    Azure CSV and Mooncake JSONL readers
- arrivals.py  Poisson, gamma (bursty) and trace-replay arrivals
- requests.py  BenchRequest: synthetic and trace requests (prompt ids, output length)
- lengths.py   the length workload: real prompts with real answer lengths
- spec.py      the workload flags of `bench serve`, `sim` and `plan`, and what they build
- metrics.py   RequestRecord and the summary statistics of a run
- goodput.py   SLOs, attainment, vLLM's and DistServe's goodput
"""
