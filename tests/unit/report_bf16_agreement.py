"""Report (not a test): how often our bf16 engine agrees with transformers in bf16, per tiny
family, on the inputs of test_model_vs_transformers (5 prompts x 40 greedy tokens per case).

    PYTHONPATH=src python -m tests.unit.report_bf16_agreement [--variant]

--variant: the batch-variant attention (SDPA), for comparison.

Per case: tokens equal to transformers' up to the first divergence (of 200), prompts whose 40
tokens are all equal (of 5), and whether each divergence fell on a near-tie (reference top-2
margin < 0.25, what the tolerance test forgives)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from pdserve.model.cpu_linear import pack_linears
from pdserve.model.loader import load_model

from .model_fixtures import hf_generate, load_hf, run_paged, tiny_checkpoint, top2_margin
from .test_model_vs_transformers import BF16_PACKED, CASES, NEW_TOKENS, _build, _prompts

TINY = ["tiny-llama", "tiny-qwen2-mqa-tied", "tiny-qwen3", "tiny-mistral-window24"]


def agreement(case: str, root: Path, tok_dir: Path) -> tuple[int, int, int, int, int]:
    """(tokens agreed before the first divergence, tokens, prompts all equal, prompts,
    divergences not on a near-tie)."""
    model_dir = _build(case, root / case, tok_dir)
    ours = load_model(model_dir, dtype="bfloat16")
    pack_linears(ours.model)
    ref = load_hf(model_dir, torch.bfloat16, attn="sdpa")
    agreed = total = full = hard = 0
    runs = run_paged(ours, _prompts(ours.config.vocab_size, seed=len(case)), NEW_TOKENS)
    for run in runs:
        ref_tokens, ref_logits = hf_generate(ref, run.prompt, NEW_TOKENS)
        total += NEW_TOKENS
        n = next(
            (i for i, (a, b) in enumerate(zip(run.tokens, ref_tokens, strict=True)) if a != b), None
        )
        if n is None:
            agreed += NEW_TOKENS
            full += 1
        else:
            agreed += n
            hard += top2_margin(ref_logits[n]) >= 0.25
    return agreed, total, full, len(runs), hard


def main() -> int:
    if "--variant" in sys.argv:
        from pdserve.model.attention.torch import TorchAttentionBackend

        TorchAttentionBackend.batch_invariant = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok_dir = tiny_checkpoint(root / "tok", vocab=512)
        sums = [0, 0, 0, 0, 0]
        for case in BF16_PACKED + TINY:
            assert case in CASES
            r = agreement(case, root, tok_dir)
            sums = [a + b for a, b in zip(sums, r, strict=True)]
            print(f"{case:32} tokens {r[0]:3}/{r[1]}  prompts {r[2]}/{r[3]}  hard {r[4]}")
        print(
            f"{'all':32} tokens {sums[0]}/{sums[1]} ({sums[0] / sums[1]:.1%})  "
            f"prompts {sums[2]}/{sums[3]}  divergences off a near-tie {sums[4]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
