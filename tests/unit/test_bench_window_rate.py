"""Trace replay with --rate and --duration: the window actually replayed is offered at the
labelled rate. The fixture is bursty: 12 requests in its first 3 s, then
one every 20 s, so rescaling the whole file to the mean rate and cutting it (the old way)
offers the opening window at several times the label."""

from __future__ import annotations

import pytest

from pdserve.cli.main import build_parser
from pdserve.workload.arrivals import mean_rate, replay_arrivals, replay_window
from pdserve.workload.spec import offered_rate, workload_at

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _bursty(tmp_path):
    stamps = [i * 0.25 for i in range(12)] + [3.0 + 20.0 * k for k in range(1, 11)]
    rows = []
    for i, t in enumerate(stamps):
        m, s = divmod(t, 60.0)
        rows.append(f"2023-11-16 18:{int(m):02d}:{s:09.6f},{30 + i},{4 + i % 3}")
    path = tmp_path / "bursty.csv"
    path.write_text(AZURE + "\n".join(rows) + "\n")
    return path, stamps


def _args(*extra: str):
    return build_parser().parse_args(
        ["bench", "serve", "--addr", "127.0.0.1:1", "--vocab-size", "1000", *extra]
    )


def test_old_whole_file_rescale_overstates_the_window(tmp_path):
    _, stamps = _bursty(tmp_path)
    times = replay_arrivals(stamps, rate=0.5)  # the old path: whole file, then cut
    window = [t for t in times if t < 9.0]
    assert len(window) / 9.0 > 2 * 0.5  # the bug this file guards against


@pytest.mark.parametrize("rate,duration", [(0.5, 9.0), (2.0, 10.0), (0.1, 60.0)])
def test_replayed_window_is_offered_at_the_label(tmp_path, rate, duration):
    path, _ = _bursty(tmp_path)
    args = _args("--trace", str(path), "--duration", str(duration))
    reqs = workload_at(args, rate)
    times = [r.arrival_s for r in reqs]
    assert len(reqs) == max(2, int(rate * duration + 0.5))
    assert mean_rate(times) == pytest.approx(rate, rel=1e-9)
    assert max(times) < duration
    off = offered_rate(reqs, args)
    assert off["mean_rate_req_s"] == pytest.approx(rate)
    assert off["num_requests"] == len(reqs)
    # the replayed requests are the trace's first ones, in order (lengths 30, 31, ...)
    assert [len(r.prompt_ids) for r in reqs] == [30 + i for i in range(len(reqs))]


def test_window_keeps_the_trace_shape():
    n, times = replay_window([0.0, 1.0, 3.0, 100.0], rate=1.0, duration_s=3.0)
    assert n == 3 and times == pytest.approx([0.0, 2 / 3, 2.0])


def test_window_rejects_bad_input():
    with pytest.raises(ValueError):
        replay_window([0.0, 1.0], rate=0.0, duration_s=5.0)
    with pytest.raises(ValueError):
        replay_window([0.0, 1.0], rate=1.0, duration_s=0.0)
