"""The router replicas a router knows of (router/cluster/peers.py): itself, and every router
a live worker reports in its heartbeats; a forgotten worker's report goes with it."""

from __future__ import annotations

from pdserve.router.cluster.peers import PeerRouters, RouterIdentity

A = RouterIdentity("ra", "h:1", "h:8000")
B = RouterIdentity("rb", "h:2", "")


def test_self_first_then_reported_routers_with_worker_counts() -> None:
    peers = PeerRouters(A)
    peers.report("w1", [A, B])
    peers.report("w2", [A, B])
    peers.report("w3", [A])
    known = peers.known(["w1", "w2", "w3"])
    assert [(k.identity.router_id, k.workers, k.is_self) for k in known] == [
        ("ra", 3, True),
        ("rb", 2, False),
    ]
    assert known[1].identity == B


def test_dead_workers_and_dropped_links_leave_the_view() -> None:
    peers = PeerRouters(A)
    peers.report("w1", [A, B])
    assert len(peers.known(["w1"])) == 2
    assert len(peers.known([])) == 1  # w1 expired from the registry: not counted
    peers.report("w1", [A])  # its link to rb failed
    assert len(peers.known(["w1"])) == 1
    peers.report("w2", [B])
    peers.forget("w2")
    assert [k.identity.router_id for k in peers.known(["w1", "w2"])] == ["ra"]
    peers.report("w3", [RouterIdentity("")])  # (an id-less entry is ignored)
    assert len(peers.known(["w3"])) == 1
