"""The emulated cluster's model directory: the modelled config.json next to a stated
tokenizer, read by the router as any checkpoint (text prompts work); worker flag aliases."""

from __future__ import annotations

import json

import pytest

from pdserve.emulate.model_dir import make_emulated_dir, wire_ratio
from pdserve.worker.main import _aliased


def test_emulated_dir_serves_text_with_the_stated_tokenizer(tmp_path, make_tiny_dirs):
    from pdserve.router.frontdoor.model_info import ModelInfo

    tok = make_tiny_dirs["llama"]
    out = make_emulated_dir(tmp_path / "emu", "llama3-8b", tok, extra={"hardware": "h100"})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 128256 and cfg["num_hidden_layers"] == 32
    assert cfg["pdserve_emulated"]["hardware"] == "h100"
    assert cfg["pdserve_emulated"]["tokenizer"] == str(tok.resolve())
    info = ModelInfo.from_dir(out)
    assert info.name == "llama3-8b" and info.vocab_size == 128256
    assert info.max_model_len == 8192
    ids = info.encode("hello world, how are you")
    assert ids and max(ids) < 128256
    assert info.eos_token_ids  # from the tokenizer's model
    # the kvstore holds as many few-byte blocks as its modelled bytes hold modelled blocks
    assert wire_ratio(out) == pytest.approx(64 / (131072 * 16))


def test_emulated_dir_needs_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer files"):
        make_emulated_dir(tmp_path / "emu", "llama3-8b", tmp_path)
    with pytest.raises(ValueError, match="unknown model config"):
        make_emulated_dir(tmp_path / "emu2", "llama9-1b", tmp_path)


def test_worker_flag_aliases():
    assert _aliased(["--emulate", "h100", "--model-config", "llama3-8b", "--profile=p.json"]) == [
        "--emulate", "h100", "--emulate-model-config", "llama3-8b", "--emulate-profile=p.json"
    ]  # fmt: skip
