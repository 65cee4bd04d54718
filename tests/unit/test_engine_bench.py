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


def test_bench_engine_dtypes_and_limits(tmp_path, tiny_llama_dir, capsys):
    """--dtype float32,bfloat16 measures both in one run; --limits adds the machine's
    bandwidth / GEMM peak per dtype and each row's achieved fractions."""
    out = tmp_path / "bench.json"
    args = ["bench", "engine", "--model", str(tiny_llama_dir), "--batch-sizes", "2"]
    args += ["--prompt-len", "12", "--gen-len", "3", "--repeats", "1", "--clock", "cpu"]
    args += ["--dtype", "float32,bfloat16,float32", "--limits", "--no-hf", "--json", str(out)]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["dtypes"] == ["float32", "bfloat16"]  # repeats dropped, order kept
    assert [(r["dtype"], r["batch"]) for r in res["rows"]] == [("float32", 2), ("bfloat16", 2)]
    for dtype in ("float32", "bfloat16"):
        lim = res["limits"][dtype]
        assert lim["dtype"] == dtype and lim["bandwidth_bytes_s"] > 0 and lim["gemm_flops_s"] > 0
    for r in res["rows"]:
        lim = res["limits"][r["dtype"]]
        assert r["prefill_fraction"] == r["prefill_flops_s"] / lim["gemm_flops_s"]
        assert r["decode_fraction"] == r["decode_bytes_s"] / lim["bandwidth_bytes_s"]
        assert r["decode_roofline_fraction"] >= r["decode_fraction"] > 0
    text = capsys.readouterr().out
    assert "bfloat16 / float32, batch 2" in text and "read bandwidth" in text


def test_bench_engine_rejects_unknown_dtype(tiny_llama_dir):
    import pytest

    with pytest.raises(SystemExit, match="unknown dtype 'fp8'"):
        main(["bench", "engine", "--model", str(tiny_llama_dir), "--dtype", "fp8", "--no-hf"])


def test_bench_engine_unpacked_arm_runs_plain_linears(tiny_llama_dir, monkeypatch):
    """--compare-unpacked builds its second engine with pack_weights off through the settings
    (not by rewriting the environment): that engine's selection says so, the first does not."""
    import argparse

    from pdserve.bench import engine as bench_engine

    monkeypatch.setenv("PDSERVE_PACK_WEIGHTS", "1")
    built = []

    def stop(engine, *_a, **_k):  # the engines are built; the measurement is not the point
        built.append(engine.kernels)
        raise StopIteration

    monkeypatch.setattr(bench_engine, "bench_ours", stop)
    args = argparse.Namespace(prompt_len=8, gen_len=2, no_hf=True, compare_variant=False)
    for packed in (True, False):
        try:
            bench_engine.bench_dtype(args, tiny_llama_dir, "float32", [1], None, packed=packed)
        except StopIteration:
            pass
    assert [k.linear for k in built] == ["onednn", "torch"]
    assert built[1].linear_why.startswith("PDSERVE_PACK_WEIGHTS=0")
    import os

    assert os.environ["PDSERVE_PACK_WEIGHTS"] == "1"  # the environment is left as it was
