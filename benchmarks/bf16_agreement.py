"""Report (not a test): how often our bf16 engine agrees with transformers in bf16, per tiny
family, on the inputs of test_model_vs_transformers (5 prompts x 40 greedy tokens per case).

    python -m benchmarks.bf16_agreement [--variant]

--variant: the batch-variant attention (SDPA), for comparison.

Per case: tokens equal to transformers' up to the first divergence (of 200), prompts whose 40
tokens are all equal (of 5), whether each divergence fell on a near-tie (reference top-2
margin < 0.25, what the tolerance test forgives), and the prompt logits' error against
transformers in fp32 (max and mean absolute, over the 5 prompts): how far each bf16 engine is
from the fp32 answer, ours and theirs side by side."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from pdserve.model.cpu_linear import pack_linears
from pdserve.model.loader import load_model
from tests.unit.model_fixtures import hf_generate, load_hf, run_paged, tiny_checkpoint, top2_margin
from tests.unit.test_model_vs_transformers import BF16_PACKED, CASES, NEW_TOKENS, _build, _prompts

TINY = ["tiny-llama", "tiny-qwen2-mqa-tied", "tiny-qwen3", "tiny-mistral-window24"]


def agreement(case: str, root: Path, tok_dir: Path) -> tuple[int, int, int, int, int, dict]:
    """(tokens agreed before the first divergence, tokens, prompts all equal, prompts,
    divergences not on a near-tie, {"ours" | "theirs": (max, mean) prompt-logit error against
    transformers in fp32})."""
    model_dir = _build(case, root / case, tok_dir)
    ours = load_model(model_dir, dtype="bfloat16")
    pack_linears(ours.model)
    ref = load_hf(model_dir, torch.bfloat16, attn="sdpa")
    ref32 = load_hf(model_dir, torch.float32, attn="eager")
    agreed = total = full = hard = 0
    err: dict[str, list[torch.Tensor]] = {"ours": [], "theirs": []}
    runs = run_paged(ours, _prompts(ours.config.vocab_size, seed=len(case)), NEW_TOKENS)
    for run in runs:
        with torch.no_grad():
            ids = torch.tensor([run.prompt])
            truth = ref32(ids).logits[0].float()
            err["theirs"].append((ref(ids).logits[0].float() - truth).abs())
        assert run.prompt_logits is not None
        err["ours"].append((run.prompt_logits.float() - truth).abs())
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
    stats = {
        k: (max(e.max().item() for e in v), sum(e.mean().item() for e in v) / len(v))
        for k, v in err.items()
    }
    return agreed, total, full, len(runs), hard, stats


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
            *r, err = agreement(case, root, tok_dir)
            sums = [a + b for a, b in zip(sums, r, strict=True)]
            print(
                f"{case:32} tokens {r[0]:3}/{r[1]}  prompts {r[2]}/{r[3]}  hard {r[4]}  "
                "prompt logits vs fp32 (max/mean): "
                f"ours {err['ours'][0]:.3f}/{err['ours'][1]:.4f}  "
                f"transformers bf16 {err['theirs'][0]:.3f}/{err['theirs'][1]:.4f}"
            )
        print(
            f"{'all':32} tokens {sums[0]}/{sums[1]} ({sums[0] / sums[1]:.1%})  "
            f"prompts {sums[2]}/{sums[3]}  divergences off a near-tie {sums[4]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
