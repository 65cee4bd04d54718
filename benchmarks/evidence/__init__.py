"""Evidence for the router's defaults: each policy against its baseline, simulated and
emulated, paired over seeds (`python -m benchmarks.evidence --help`)."""
