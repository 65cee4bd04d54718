"""ModelRunner: turns a scheduler plan into tensors, runs the model, samples.

The batch is flattened (no padding): entry i contributes tokens
`all_token_ids[start_i : start_i + n_i]` at positions `start_i .. start_i + n_i - 1`.
Only entries whose step reaches their last known token are sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.sampler import Sampler, SampleRequest
from pdserve.engine.scheduler import SchedulerPlan
from pdserve.logging import get_logger
from pdserve.model.attention.metadata import AttentionMetadata
from pdserve.model.cpu_linear import linear_kind, pack_linears
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import KernelSelection, linear_bound, select_kernels

_log = get_logger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: str = "cpu",
        sampler: Sampler | None = None,
        pack_weights: bool | None = None,
        batch_invariant: bool = True,
        window_group: bool = False,
        kernel_settings: KernelSettings | None = None,
    ) -> None:
        """kernel_settings: the kernel switches (None: this process's `PDSERVE_*` environment);
        `pdserve.model.kernels.select_kernels` turns them, the dtype, the device and
        `batch_invariant` into the record `self.kernels`, which the model then runs.
        pack_weights: overrides kernel_settings.pack_weights (on CPU, the model's linears are
        swapped in place for prepacked ones, pdserve.model.cpu_linear: ~2x faster bf16 decode,
        ~1.3x fp32 prefill; False is the baseline of `pdserve bench engine
        --compare-unpacked`).
        batch_invariant: a request's tokens do not depend on the rest of the batch, its chunking
        or the path it took (attention.fixed, cpu_linear); False = the faster SDPA attention.
        Invariance needs the packed linears on CPU (plain F.linear is not row-invariant).
        window_group: the sliding layers' caches are a second pool addressed by each
        sequence's `window_table` (AttentionMetadata.window; kv/window_group.py)."""
        settings = kernel_settings or KernelSettings.from_env()
        if pack_weights is not None:
            settings = settings.model_copy(update={"pack_weights": pack_weights})
        self.kernels: KernelSelection = select_kernels(
            settings,
            model.embed_tokens.weight.dtype,
            device,
            batch_invariant,
            model=getattr(model, "config", None),
            kv_quantized=any(c.dim() == 2 for c in kv_caches),
        )
        if self.kernels.linear != "torch":
            pack_linears(model, batch_invariant=batch_invariant, kernel=self.kernels.linear)
        if str(device).startswith("cpu"):  # packing is in place: a shared model keeps its own
            self.kernels = linear_bound(self.kernels, linear_kind(model))
        model.set_batch_invariant(batch_invariant)  # every attention the model runs
        if hasattr(model, "use_kernels"):  # after packing: a direct loop holds packed weights
            self.kernels = model.use_kernels(self.kernels)
        _log.info("kernels", summary=self.kernels.summary(), **self.kernels.reasons())
        if self.kernels.warning:
            _log.warning("batch invariance is not kept", reason=self.kernels.warning)
        self.batch_invariant = batch_invariant
        self.window_group = window_group
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler or Sampler()

    def execute(
        self, plan: SchedulerPlan, layer_callback: Callable[[int], None] | None = None
    ) -> dict[str, int]:
        """Run one step; returns request_id -> sampled token for entries with `sample`."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, window_tables = [], [], [], []
        last_index: list[int] = []  # row in the flat batch of each sampled entry's last token
        sample_reqs: list[SampleRequest] = []
        sample_ids: list[str] = []
        for e in plan.scheduled:
            seq, start, n = e.seq, e.start, e.num_new_tokens
            all_ids = seq.all_token_ids
            ids.extend(all_ids[start : start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            window_tables.append(seq.window_table)
            if e.sample:
                last_index.append(len(ids) - 1)
                sample_reqs.append(SampleRequest(seq.params, seq.num_output_tokens))
                sample_ids.append(seq.request_id)
        meta = AttentionMetadata.build(
            query_lens,
            seq_lens,
            tables,
            self.block_size,
            self.device,
            window_block_tables=window_tables if self.window_group else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        with torch.inference_mode():
            hidden = self.model(input_ids, pos, self.kv_caches, meta, layer_callback=layer_callback)
            if not sample_ids:
                return {}
            idx = torch.tensor(last_index, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[idx])  # [N, vocab] float32
            if all(r.params.temperature == 0.0 for r in sample_reqs):
                tokens = logits.argmax(dim=-1).tolist()
            else:
                tokens = self.sampler(logits, sample_reqs)
        return dict(zip(sample_ids, tokens, strict=True))

    # ---- KV import / export (block granularity) ----------------------------------------
    def read_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """[n, 2, block_size, kv_heads, head_dim], a contiguous CPU copy."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[layer].device)
        return self.kv_caches[layer].index_select(0, idx).to("cpu", copy=True).contiguous()

    def write_layer(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        cache = self.kv_caches[layer]
        if tuple(kv.shape[1:]) != tuple(cache.shape[1:]) or kv.shape[0] != len(block_ids):
            raise ValueError(
                f"kv shape {tuple(kv.shape)} does not match {len(block_ids)} blocks of "
                f"{tuple(cache.shape[1:])}"
            )
        idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        cache.index_copy_(0, idx, kv.to(device=cache.device, dtype=cache.dtype))

    def empty_kv(self, shape) -> torch.Tensor:
        """An uninitialised CPU tensor of the cache's dtype (UCX receives, kvstore fetches)."""
        return torch.empty(tuple(shape), dtype=self.kv_caches[0].dtype)

    def read_blocks(
        self, block_ids: list[int], per_layer: list[list[int]] | None = None
    ) -> torch.Tensor:
        """[n, elems per block] CPU tensor: each block's stored layers back to back (layers may
        differ in shape; for equal shapes this is [n, L, 2, bs, kvh, hd] flattened).
        `per_layer`: each layer's own block ids of the same n logical blocks (window group)."""
        n = len(block_ids)
        ids = per_layer or [block_ids] * len(self.kv_caches)
        return torch.cat(
            [self.read_layer(i, ids[i]).view(n, -1) for i in range(len(self.kv_caches))], 1
        )
