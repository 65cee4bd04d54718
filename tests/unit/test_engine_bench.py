"""`pdserve bench engine` on a tiny checkpoint: runs end to end and reports both sides."""

import json

from pdserve.cli.main import main


def test_bench_engine_tiny(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "engine",
            "--model",
            str(tiny_llama_dir),
            "--batch-sizes",
            "1,3",
            "--prompt-len",
            "20",
            "--gen-len",
            "5",
            "--repeats",
            "1",
            "--clock",
            "cpu",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        for k in ("ours_prefill_tok_s", "ours_decode_tok_s", "hf_prefill_tok_s", "hf_decode_tok_s"):
            assert r[k] > 0
    text = capsys.readouterr().out
    assert "decode scaling" in text and "ratio" in text


def test_bench_dispatcher_lists_engine(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "engine" in capsys.readouterr().out
