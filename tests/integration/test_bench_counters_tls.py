"""`bench compare` reads each worker's counters (preemptions) over the cluster's mutual TLS:
the certificate folder comes from `pdserve up`'s ready line. A plaintext call to a default
cluster is refused, which silently read as 'no preemptions' before."""

from __future__ import annotations

import pytest

from pdserve.bench.cluster import UpProcess
from pdserve.bench.lengths import cluster_preemptions

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")


def test_counters_are_read_over_mutual_tls(tmp_path):
    up = UpProcess(["--mode", "colocated", "--colocated", "1", "--no-kvstore"], port=0,
                   ready_timeout_s=180.0, log_path=tmp_path / "up.log")  # fmt: skip
    with up as addr:
        assert up.tls_dir is not None
        secure = cluster_preemptions(addr, up.tls_dir)
        plain = cluster_preemptions(addr)
    assert len(secure["per_instance"]) == 1 and secure["total"] == 0
    assert plain["per_instance"] == {}  # refused over plaintext: nothing read
