"""Azure CSV and Mooncake JSONL parsers, including malformed lines."""

from __future__ import annotations

import pytest

from pdserve.workload.traces import (
    TraceFormatError,
    read_azure_csv,
    read_mooncake_jsonl,
    read_trace,
)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,12,3
"""


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_azure_parses_relative_times(tmp_path):
    recs = read_azure_csv(write(tmp_path, "a.csv", AZURE))
    assert [(r.input_len, r.output_len) for r in recs] == [(374, 44), (396, 109), (12, 3)]
    assert recs[0].timestamp_s == 0.0
    assert recs[1].timestamp_s == pytest.approx(4.314579, abs=1e-6)
    assert recs[2].timestamp_s == pytest.approx(4.31941, abs=1e-6)
    assert read_azure_csv(write(tmp_path, "b.csv", AZURE), limit=2)[-1].input_len == 396


@pytest.mark.parametrize(
    ("bad_line", "words"),
    [
        ("2023-11-16 18:15:52.0,374", "columns"),
        ("2023-11-16 18:15:52.0,abc,44", "ContextTokens"),
        ("2023-11-16 18:15:52.0,10,-5", "negative"),
        ("yesterday,10,5", "TIMESTAMP"),
    ],
)
def test_azure_malformed_line_names_file_and_line(tmp_path, bad_line, words):
    path = write(tmp_path, "bad.csv", AZURE + bad_line + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_azure_csv(path)
    assert err.value.line == 5
    assert str(path) in str(err.value) and ":5:" in str(err.value)
    assert words in str(err.value)


def test_azure_bad_header(tmp_path):
    with pytest.raises(TraceFormatError, match="GeneratedTokens"):
        read_azure_csv(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens\n1,2\n"))


MOON = """{"timestamp": 1000, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]}
{"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [0, 3]}

{"timestamp": 4000, "input_length": 10, "output_length": 1, "hash_ids": [9]}
"""


def test_mooncake_parses(tmp_path):
    recs = read_mooncake_jsonl(write(tmp_path, "m.jsonl", MOON))
    assert [r.timestamp_s for r in recs] == [0.0, 0.5, 3.0]
    assert recs[0].hash_ids == (0, 1, 2)
    assert (recs[1].input_len, recs[1].output_len) == (600, 7)
    assert len(read_trace(write(tmp_path, "m2.jsonl", MOON))) == 3  # auto by extension


@pytest.mark.parametrize(
    ("bad_line", "words"),
    [
        ('{"timestamp": 5000, "input_length": 10', "bad JSON"),
        ('{"timestamp": 5000, "output_length": 10}', "input_length"),
        ('{"timestamp": 5000, "input_length": "ten", "output_length": 1}', "not a number"),
        ('{"timestamp": 5000, "input_length": -3, "output_length": 1}', "negative"),
        ('{"timestamp": "x", "input_length": 3, "output_length": 1}', "timestamp"),
        ('{"timestamp": 5000, "input_length": 3, "output_length": 1, "hash_ids": 4}', "hash_ids"),
        ("[1, 2]", "object"),
    ],
)
def test_mooncake_malformed_line_names_file_and_line(tmp_path, bad_line, words):
    path = write(tmp_path, "bad.jsonl", MOON + bad_line + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_mooncake_jsonl(path)
    assert err.value.line == 5 and err.value.path == str(path)
    assert f"{path}:5:" in str(err.value) and words in str(err.value)


def test_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(write(tmp_path, "x.csv", AZURE), fmt="parquet")


def test_trace_offset_replays_a_later_window(tmp_path):
    import argparse

    from pdserve.workload.spec import add_workload_args, trace_window, workload_at

    rows = "".join(f"2023-11-16 18:16:{i:02d}.0,{100 + i},{10 + i}\n" for i in range(10))
    path = write(tmp_path, "w.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    p = argparse.ArgumentParser()
    add_workload_args(p)

    def args(*extra: str) -> argparse.Namespace:
        return p.parse_args(["--trace", str(path), "--vocab-size", "1000", *extra])

    # requests 4..6 of the trace: the window's lengths, arrivals re-based at 0
    win = trace_window(args("--trace-offset", "4", "--num-requests", "3"))
    assert [(r.input_len, r.output_len) for r in win] == [(104, 14), (105, 15), (106, 16)]
    reqs = workload_at(args("--trace-offset", "4", "--num-requests", "3"), None)
    assert [len(r.prompt_ids) for r in reqs] == [104, 105, 106]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0]
    assert len(trace_window(args("--trace-offset", "8"))) == 2  # to the end without a count
    assert trace_window(args("--trace-offset", "0", "--num-requests", "2"))[-1].input_len == 101
    with pytest.raises(ValueError, match="trace-offset"):
        trace_window(args("--trace-offset", "-1"))
