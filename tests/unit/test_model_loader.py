"""Loader: clear ModelLoadError for bad checkpoints; sharded weights; fingerprint identity;
config parsing; make-tiny determinism; the built-in tiny; torch-free config/tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.cli.main import main as cli_main
from pdserve.errors import ModelLoadError
from pdserve.model.config import ModelConfig
from pdserve.model.loader import load_model
from pdserve.model.tiny import ensure_builtin_tiny

from .model_fixtures import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", vocab=512)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(d)


def test_unsupported_rope_scaling(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope_scaling type 'yarn' unsupported"):
        load_model(d)


def test_missing_files(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    d = _copy(tiny, tmp_path / "a")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing config\.json"):
        load_model(d)
    d = _copy(tiny, tmp_path / "b")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(d)


def test_wrong_shape_names_the_tensor(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    sd[name] = torch.zeros(sd[name].shape[0] + 16, sd[name].shape[1])
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name}.*shape \[48, 64\].*\[32, 64\]"):
        load_model(d)


def test_missing_and_unexpected_tensor(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"missing tensor.*model\.layers\.0\.mlp\.up_proj\.weight"
    ):
        load_model(d)
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(192, 64)
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"
    ):
        load_model(d)


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, d / fname)
        weight_map |= dict.fromkeys(keys, fname)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(tiny), load_model(d)
    for (na, pa), (nb, pb) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert na == nb and torch.equal(pa, pb)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weight shard model-00002-of-00002"):
        load_model(d)


def test_fingerprint_identity(tiny, tmp_path):
    fp = load_model(tiny).fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert load_model(_copy(tiny, tmp_path / "copy")).fingerprint == fp
    assert load_model(tiny, dtype="bfloat16").fingerprint != fp
    other = tiny_checkpoint(tmp_path / "seed1", vocab=512, seed=1)
    assert load_model(other).fingerprint != fp


def test_config_fields(tmp_path):
    d = tiny_checkpoint(tmp_path / "q3", family="qwen3", heads=4, kv_heads=1, tie=True, vocab=512)
    c = ModelConfig.from_dir(d)
    assert (c.architecture, c.num_kv_heads, c.head_dim, c.qk_norm) == (
        "Qwen3ForCausalLM",
        1,
        32,
        True,
    )
    assert c.tie_word_embeddings and c.bos_token_id == 0 and c.eos_token_ids[0] == 1
    assert len(c.eos_token_ids) == 2  # generation_config adds <|end|>
    m = ModelConfig.from_dir(tiny_checkpoint(tmp_path / "mi", family="mistral", vocab=512))
    assert m.sliding_window == 48 and m.layer_window(1) == 48
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 300,
        "intermediate_size": 128,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    c = ModelConfig.from_dict(raw)
    assert c.rope_theta == 5e5 and c.rope_scaling["rope_type"] == "llama3" and c.num_kv_heads == 4


def test_make_tiny_is_byte_deterministic(tmp_path):
    """Same flags + seed -> identical bytes, across processes (tokenizer training included)."""
    args = [
        "model",
        "make-tiny",
        "--family",
        "qwen2",
        "--seed",
        "7",
        "--vocab",
        "600",
        "--kv-heads",
        "1",
        "--tie",
        "--dtype",
        "bfloat16",
    ]
    assert cli_main([*args, str(tmp_path / "a")]) == 0
    subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", *args, str(tmp_path / "b")],
        check=True,
        capture_output=True,
    )
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert cli_main([*args[:5], "8", *args[6:], str(tmp_path / "c")]) == 0
    assert (tmp_path / "c/model.safetensors").read_bytes() != (
        tmp_path / "a/model.safetensors"
    ).read_bytes()
    assert load_model(tmp_path / "a").dtype == torch.bfloat16


def test_ensure_builtin_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    d = ensure_builtin_tiny()
    assert d == tmp_path / "home" / "tiny-llama"
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_tiny() == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "home").iterdir()] == ["tiny-llama"]  # no temp left
    assert load_model(d).config.architecture == "LlamaForCausalLM"
    assert ensure_builtin_tiny(tmp_path / "other") == tmp_path / "other" / "tiny-llama"


def test_ensure_builtin_tiny_concurrent(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: ensure_builtin_tiny(tmp_path), range(3)))
    assert dirs == [tmp_path / "tiny-llama"] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]
    assert load_model(dirs[0]).tokenizer.encode("hello")[0] == 0


def test_config_and_tokenizer_import_without_torch():
    code = (
        "import sys; import pdserve.model.config, pdserve.model.tokenizer; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
