"""The direct layer loop (pdserve.model.direct_loop) against the module loop: every step of a
mixed workload (chunked prefills next to decodes, several lengths, a sliding window, a
quantized KV cache) gives bit-identical hidden states, and when the loop cannot run a step
(no kernel plan, qwen3's per-head norms, the loop switched off) the module loop does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.model.direct_loop import DirectLoop
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import select_kernels
from pdserve.model.tiny import TinySpec, make_tiny

PROMPT_LENS = (5, 37, 70, 1, 16)  # over 40-token steps: chunked, mixed with decodes
_HERE = select_kernels(KernelSettings(), torch.bfloat16, "cpu", True)  # a bf16 engine here
needs_kernels = pytest.mark.skipif(
    _HERE.loop != "direct", reason=f"no direct loop here: {_HERE.loop_why}"
)


class _Counting:
    """Wraps a DirectLoop and counts the steps it ran."""

    def __init__(self, loop: DirectLoop) -> None:
        self.loop, self.calls = loop, 0

    def accepts(self, plan: object) -> bool:
        return self.loop.accepts(plan)

    def __call__(self, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.loop(*args)


def _run(
    model_dir: Path, direct: bool, **config: object
) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """(tokens per request, every step's hidden states, steps the direct loop ran)."""
    engine = LLMEngine(
        EngineConfig(
            model_dir,
            dtype="bfloat16",
            num_blocks=64,
            max_num_batched_tokens=40,
            max_num_seqs=8,
            enable_prefix_caching=False,
            kernels=KernelSettings(direct_loop=direct),
            **config,  # type: ignore[arg-type]
        )
    )
    assert engine.kernels.loop == ("direct" if direct else "module")  # the record runs
    model = engine.runner.model
    counting = None
    if model.direct_loop is not None:
        counting = model.direct_loop = _Counting(model.direct_loop)
    hiddens: list[torch.Tensor] = []
    forward = model.forward

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        hidden = forward(*args, **kwargs)
        hiddens.append(hidden.clone())
        return hidden

    model.forward = recording
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, n in enumerate(PROMPT_LENS):
        prompt = torch.randint(3, engine.vocab_size, (n,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values()), hiddens, counting.calls if counting else 0


@needs_kernels
@pytest.mark.parametrize(
    ("family", "kv_dtype"),
    [("llama", None), ("qwen2", None), ("mistral", None), ("llama", "int8")],
)
def test_direct_loop_bits_equal_module_loop(family, kv_dtype, tmp_path):
    """qwen2: q/k/v biases; mistral: a 48-token sliding window (prompts of 70); int8: the
    quantized cache goes through the backend inside the direct loop."""
    model_dir = make_tiny(tmp_path / family, TinySpec(family=family, vocab=512))
    ref_tokens, ref_hidden, ref_direct = _run(model_dir, False, kv_dtype=kv_dtype)
    tokens, hidden, direct = _run(model_dir, True, kv_dtype=kv_dtype)
    assert ref_direct == 0
    assert direct == len(hidden) > len(PROMPT_LENS)  # every step ran the direct loop
    assert tokens == ref_tokens
    assert len(hidden) == len(ref_hidden)
    for step, (a, b) in enumerate(zip(hidden, ref_hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: hidden states differ"


@needs_kernels
def test_direct_loop_calls_the_layer_callback_in_order(tmp_path):
    """The disaggregated prefill streams layer i's KV from the callback: the direct loop calls
    it after each layer, in order, when layer i's K/V are in its cache and the next layer's
    are not yet."""
    model_dir = make_tiny(tmp_path / "m", TinySpec(vocab=512, layers=3))
    engine = LLMEngine(EngineConfig(model_dir, dtype="bfloat16", num_blocks=16))
    model = engine.runner.model
    assert model.direct_loop is not None
    caches = engine.runner.kv_caches
    seen: list[tuple[int, list[bool]]] = []

    def callback(layer: int) -> None:
        seen.append((layer, [bool(c.abs().sum() > 0) for c in caches]))

    for c in caches:
        c.zero_()
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=1))
    forward = model.forward
    model.forward = lambda *a, **k: forward(*a, **{**k, "layer_callback": callback})
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == [(i, [j <= i for j in range(3)]) for i in range(3)]


@needs_kernels
def test_module_loop_runs_what_the_direct_loop_cannot(tmp_path):
    """qwen3 (per-head q/k norms), fp32, a batch-variant engine (oneDNN linears, no kernel
    entries) and direct_loop=False (PDSERVE_DIRECT_LOOP=0) build no loop; a built loop refuses a step whose
    attention plan is not the kernel's."""

    def loop(model_dir: Path, **config: object) -> DirectLoop | None:
        engine = LLMEngine(EngineConfig(model_dir, num_blocks=8, **config))  # type: ignore[arg-type]
        built = engine.runner.model.direct_loop
        assert (built is not None) == (engine.kernels.loop == "direct")  # the record runs
        return built

    qwen3 = make_tiny(tmp_path / "q3", TinySpec(family="qwen3", vocab=512))
    llama = make_tiny(tmp_path / "l", TinySpec(vocab=512))
    built = loop(llama, dtype="bfloat16")
    assert built is not None
    assert built.accepts(object()) is False
    assert loop(qwen3, dtype="bfloat16") is None
    assert loop(llama, dtype="float32") is None
    assert loop(llama, dtype="bfloat16", batch_invariant=False) is None
    assert loop(llama, dtype="bfloat16", kernels=KernelSettings(direct_loop=False)) is None
