"""`plan --prices`: configurations ranked by cost per goodput."""

from __future__ import annotations

import pytest

from pdserve.sim.plan import cost_per_m_tokens, cost_ranking


def _row(label, devices, rate, out=100.0):
    return {"label": label, "devices": devices, "goodput_req_s": rate, "mean_output_tokens": out}


def test_cheapest_per_goodput_first_across_hardware_types():
    prices = {"h100": 2.5, "l40s": 0.9}
    rows = [
        _row("4 x h100", {"h100": 4}, 40.0),  # 10 $/h -> 0.25 $/h per req/s
        _row("2P h100 : 2D l40s", {"h100": 2, "l40s": 2}, 22.0),  # 6.8 $/h -> 0.309
        _row("4 x l40s", {"l40s": 4}, 16.0),  # 3.6 $/h -> 0.225
    ]
    ranked = cost_ranking(rows, prices)
    assert [r["label"] for r in ranked] == ["4 x l40s", "4 x h100", "2P h100 : 2D l40s"]
    top = ranked[0]
    assert top["usd_per_hour"] == pytest.approx(3.6)
    assert top["usd_per_hour_per_req_s"] == pytest.approx(3.6 / 16.0)
    assert top["cost_per_m_output_tokens"] == pytest.approx(3.6 / (16.0 * 100 * 3600) * 1e6)
    assert top["cost_per_m_output_tokens"] == cost_per_m_tokens({"l40s": 4}, prices, 16.0, 100)
    # the most goodput per device is not the cheapest
    assert max(ranked, key=lambda r: r["per_device_goodput"])["label"] == "4 x h100"


def test_unpriced_or_zero_goodput_rank_last_by_goodput():
    rows = [_row("a", {"h100": 1}, 0.0), _row("b", {"a100": 2}, 10.0),
            _row("c", {"h100": 2}, 10.0)]  # fmt: skip
    ranked = cost_ranking(rows, {"h100": 2.0})
    assert [r["label"] for r in ranked] == ["c", "b", "a"]
    assert ranked[1]["usd_per_hour"] is None and ranked[2]["usd_per_hour_per_req_s"] is None
    assert [r["label"] for r in cost_ranking(rows, {})] == ["b", "c", "a"]
