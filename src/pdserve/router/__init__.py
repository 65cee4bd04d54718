"""pdserve router: the public endpoint, worker registry and request orchestration (no torch)."""
