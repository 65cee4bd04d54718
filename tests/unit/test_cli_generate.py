"""`pdserve generate --model DIR` in-process, and its validation errors (exit code 2)."""

import json

import pytest

from pdserve.cli.main import main

FIELDS = (
    "token_ids",
    "text",
    "finish_reason",
    "prompt_tokens",
    "cached_tokens",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
)


def run(capsys, *argv):
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_with_prompt_ids_matches_engine(capsys, tiny_llama_dir, make_engine):
    from pdserve.engine.params import SamplingParams

    code, out, _ = run(
        capsys,
        "--model",
        str(tiny_llama_dir),
        "--prompt-ids",
        "3,4,5,6",
        "--max-tokens",
        "7",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert code == 0
    obj = json.loads(out)
    assert set(FIELDS) <= set(obj)
    ref = make_engine().generate(
        [[3, 4, 5, 6]], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    )[0]
    assert obj["token_ids"] == ref
    assert obj["finish_reason"] == "length" and obj["prompt_tokens"] == 4
    assert obj["e2e_ms"] >= obj["ttft_ms"] > 0


def test_text_prompt_with_tokenizer(capsys, make_tiny_dirs):
    model = str(make_tiny_dirs["llama"])
    args = ["--model", model, "--prompt", "Hello there", "--max-tokens", "5"]
    args += ["--temperature", "0.7", "--seed", "3", "--json"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    obj = json.loads(out)
    assert 1 <= len(obj["token_ids"]) <= 5 and isinstance(obj["text"], str)
    assert obj["prompt_tokens"] > 1
    code2, out2, _ = run(capsys, *args)
    assert code2 == 0 and json.loads(out2)["token_ids"] == obj["token_ids"]  # seeded


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--prompt-ids", ""], "prompt"),
        (["--prompt-ids", "1,x"], "prompt_ids"),
        (["--prompt-ids", "1,100000"], "prompt_token_ids"),
        (["--prompt-ids", "1,2", "--max-tokens", "100000"], "max_tokens"),
        (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens"),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
        (["--prompt-ids", "1", "--top-p", "0"], "top_p"),
        (["--prompt-ids", "1", "--top-p", "1.5"], "top_p"),
        (["--prompt-ids", "1", "--top-k", "-2"], "top_k"),
    ],
)
def test_invalid_input_exit_2_names_field(capsys, tiny_llama_dir, argv, field):
    code, out, err = run(capsys, "--model", str(tiny_llama_dir), *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0]
