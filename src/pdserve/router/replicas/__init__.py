"""What router replicas agree on, through one shared store (Redis): per-key limits across
replicas (key_limits.py) and who may flip instances (leader.py). Everything else a replica
knows it learns from the workers (cluster/peers.py)."""
