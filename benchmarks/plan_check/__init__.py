"""Does `pdserve plan` pick well? Its pick against a sweep of configurations, simulated and
emulated (`python -m benchmarks.plan_check --help`)."""
