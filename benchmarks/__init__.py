"""The lab: one-off A/B scripts and the evidence and reproduction harnesses. Not installed;
run from the repository root as `python -m benchmarks.<name>` (see README.md here)."""
