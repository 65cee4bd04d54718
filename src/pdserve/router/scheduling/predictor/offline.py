"""The offline text model: a length score from the prompt text (hashed n-gram
TF-IDF ridge + structure features, blended with a k-nearest-prompt vote), and
a per-model calibration that turns the score into p50 / p90 completion tokens.

Inference is numpy only (the router imports no torch and no scikit-learn).
`train` fits it from rows of the length data (`prompt`, `model_canonical`,
`response_tokens_cl100k`, `prompt_split`) deterministically: kernel ridge in its
dual form over unique prompts (about a thousand), so no sparse-matrix library is
needed either. The target is the prompt's mean within-model normal score of its
answers' lengths: it pools every model's answer to a prompt, and ranks are
robust to the datasets' different length caps."""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from . import artifact
from .base import LengthEstimate, LengthQuery, OutputLengthPredictor
from .features import NUM_STRUCT, hashed_ngrams, structure

FORMAT = "pdserve-length-model/1"
DEFAULT_DIR = Path(__file__).with_name("default")


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 1 << 16
    ridge: float = 1.0
    struct_weight: float = 0.15
    knn_k: int = 20
    knn_beta: float = 0.5
    knn_keep: int = 512  # strongest entries kept per stored training prompt
    folds: int = 5
    slope_shrink: float = 20.0


class SparseRows:
    """Rows of L2-normalised sparse vectors stored column-sorted, for dot
    products of one query against all rows."""

    def __init__(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int) -> None:
        order = np.lexsort((rows, cols))
        self.rows = rows[order].astype(np.int32)
        self.cols = cols[order].astype(np.int64)
        self.vals = vals[order].astype(np.float32)
        self.n = n

    def dots(self, idx: np.ndarray, val: np.ndarray) -> np.ndarray:
        lo = np.searchsorted(self.cols, idx, "left")
        hi = np.searchsorted(self.cols, idx, "right")
        counts = hi - lo
        total = int(counts.sum())
        if total == 0:
            return np.zeros(self.n)
        starts = np.repeat(lo - np.cumsum(counts) + counts, counts)
        gather = starts + np.arange(total)
        weights = self.vals[gather] * np.repeat(val, counts)
        return np.bincount(self.rows[gather], weights=weights, minlength=self.n)


def _tfidf(idx: np.ndarray, val: np.ndarray, idf: np.ndarray) -> np.ndarray:
    v = val * idf[idx]
    norm = float(np.sqrt((v * v).sum()))
    return v / norm if norm > 0 else v


def _knn_vote(sims: np.ndarray, y: np.ndarray, k: int) -> float:
    if len(sims) == 0:
        return 0.0
    k = min(k, len(sims))
    top = np.argpartition(-sims, k - 1)[:k]
    w = np.maximum(sims[top], 0.0)
    s = float(w.sum())
    return float((w * y[top]).sum() / s) if s > 0 else float(y.mean())


def canonical_model(name: str) -> str:
    """'org/Model-X' and 'org__Model-X' both become 'model-x'."""
    return name.replace("__", "/").rsplit("/", 1)[-1].lower()


class TextLengthModel(OutputLengthPredictor):
    """Offline predictor; learns nothing online (wrap it in OnlineLengthPredictor)."""

    name = "text"

    def __init__(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a length model artifact: format {meta.get('format')!r}")
        self.meta = dict(meta)
        self.dim = int(meta["dim"])
        self.idf = arrays["idf"].astype(np.float64)
        self.w = arrays["w"].astype(np.float64)
        self.s_mu = arrays["s_mu"].astype(np.float64)
        self.s_sd = arrays["s_sd"].astype(np.float64)
        self.s_w = arrays["s_w"].astype(np.float64)
        self.y_mean = float(meta["y_mean"])
        self.knn_k = int(meta["knn_k"])
        self.knn_beta = float(meta["knn_beta"])
        self.knn_y = arrays["knn_y"].astype(np.float64)
        self.knn = SparseRows(
            arrays["knn_rows"], arrays["knn_cols"], arrays["knn_vals"], len(self.knn_y)
        )
        self.cal = {m: tuple(v) for m, v in meta["calibration"].items()}
        self.pooled = tuple(meta["pooled_calibration"])
        self._by_canon = {canonical_model(m): m for m in sorted(self.cal)}

    # -- persistence
    @classmethod
    def load(cls, path: str | Path = DEFAULT_DIR) -> TextLengthModel:
        meta, arrays = artifact.load(path)
        return cls(meta, arrays)

    # -- inference
    def score(self, text: str, num_prompt_tokens: int) -> float:
        idx, val = hashed_ngrams(text, self.dim)
        x = _tfidf(idx, val, self.idf)
        s = (structure(text, num_prompt_tokens) - self.s_mu) / self.s_sd
        ridge = float(x @ self.w[idx]) + float(s @ self.s_w) + self.y_mean
        vote = _knn_vote(self.knn.dots(idx, x), self.knn_y, self.knn_k)
        return ridge + self.knn_beta * (vote - self.y_mean)

    def calibration(self, model: str) -> tuple[float, float, float, float]:
        key = model if model in self.cal else self._by_canon.get(canonical_model(model), "")
        return self.cal.get(key, self.pooled)  # type: ignore[return-value]

    def knows_model(self, model: str) -> bool:
        return model in self.cal or canonical_model(model) in self._by_canon

    def log_quantiles(self, score: float, model: str) -> tuple[float, float]:
        c, s, q50, q90 = self.calibration(model)
        mu = c + s * score
        return mu + q50, mu + q90

    def estimate(self, query: LengthQuery) -> LengthEstimate:
        text = query.text if query.text is not None else ""
        l50, l90 = self.log_quantiles(self.score(text, query.num_prompt_tokens), query.model)
        return LengthEstimate(math.expm1(l50), math.expm1(l90), "text").clamp(query.max_tokens)


# ----------------------------------------------------------------------------- training


def _prompt_key(row: Mapping[str, Any]) -> str:
    return f"{row.get('source', '')}/{row.get('prompt_id') or row['prompt']}"


def _fold(key: str, folds: int) -> int:
    return zlib.crc32(key.encode("utf-8")) % folds


def _rank_targets(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per prompt: mean over its answers of the answer's within-model normal score."""
    nd = NormalDist()
    by_model: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_model[r["model_canonical"]].append(r)
    per_prompt: dict[str, list[float]] = defaultdict(list)
    for m in sorted(by_model):
        rs = by_model[m]
        lengths = np.asarray([float(r["response_tokens_cl100k"]) for r in rs])
        order = np.argsort(lengths, kind="mergesort")
        ranks = np.empty(len(rs))
        ranks[order] = np.arange(len(rs))
        for r, rank in zip(rs, ranks, strict=True):
            per_prompt[_prompt_key(r)].append(nd.inv_cdf((rank + 0.5) / len(rs)))
    return {k: float(np.mean(v)) for k, v in per_prompt.items()}


def train(rows: Iterable[Mapping[str, Any]], config: TrainConfig | None = None) -> TextLengthModel:
    """Fit on the given rows (callers pass the train split). Deterministic."""
    cfg = config or TrainConfig()
    rows = sorted(
        (r for r in rows if r.get("prompt") is not None),
        key=lambda r: (
            _prompt_key(r),
            str(r["model_canonical"]),
            int(r["response_tokens_cl100k"]),
            str(r.get("id", "")),
        ),
    )  # the input order must not matter
    if not rows:
        raise ValueError("no training rows")
    targets = _rank_targets(rows)
    prompts: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        prompts.setdefault(_prompt_key(r), r)
    keys = sorted(prompts)
    n = len(keys)
    y = np.asarray([targets[k] for k in keys])
    y_mean = float(y.mean())

    raw = [hashed_ngrams(prompts[k]["prompt"], cfg.dim) for k in keys]
    df = np.zeros(cfg.dim)
    for idx, _ in raw:
        df[idx] += 1.0
    idf = np.log((1.0 + n) / (1.0 + df)) + 1.0
    vecs = [(idx, _tfidf(idx, val, idf)) for idx, val in raw]
    full = SparseRows(
        np.concatenate([np.full(len(i), r) for r, (i, _) in enumerate(vecs)]),
        np.concatenate([i for i, _ in vecs]),
        np.concatenate([v for _, v in vecs]),
        n,
    )
    kx = np.vstack([full.dots(i, v) for i, v in vecs])
    kx = (kx + kx.T) / 2.0
    struct = np.vstack(
        [
            structure(prompts[k]["prompt"], int(prompts[k].get("prompt_tokens_cl100k") or 0))
            for k in keys
        ]
    )
    s_mu = struct.mean(0)
    s_sd = struct.std(0) + 1e-9
    s_std = (struct - s_mu) / s_sd
    ew2 = cfg.struct_weight**2
    kernel = kx + ew2 * (s_std @ s_std.T)

    def fit(train_idx: np.ndarray) -> np.ndarray:
        sub = kernel[np.ix_(train_idx, train_idx)] + cfg.ridge * np.eye(len(train_idx))
        yt = y[train_idx]
        return np.linalg.solve(sub, yt - yt.mean())

    # Out-of-fold scores feed the per-model calibration (in-sample ones are overfit).
    fold = np.asarray([_fold(k, cfg.folds) for k in keys])
    oof = np.zeros(n)
    for f in range(cfg.folds):
        held = np.flatnonzero(fold == f)
        tr = np.flatnonzero(fold != f)
        if len(held) == 0 or len(tr) == 0:
            continue
        alpha = fit(tr)
        ym = float(y[tr].mean())
        ridge = kernel[np.ix_(held, tr)] @ alpha + ym
        votes = np.asarray([_knn_vote(kx[h, tr], y[tr], cfg.knn_k) for h in held])
        oof[held] = ridge + cfg.knn_beta * (votes - ym)

    alpha = fit(np.arange(n))
    w = np.zeros(cfg.dim)
    for a, (idx, v) in zip(alpha, vecs, strict=True):
        w[idx] += a * v
    s_w = ew2 * (s_std.T @ alpha)

    # kNN store: strongest entries of each prompt, renormalised.
    kr, kc, kv = [], [], []
    for r, (idx, v) in enumerate(vecs):
        keep = np.sort(np.argsort(-np.abs(v), kind="mergesort")[: cfg.knn_keep])
        vv = v[keep] / (np.linalg.norm(v[keep]) or 1.0)
        kr.append(np.full(len(keep), r))
        kc.append(idx[keep])
        kv.append(vv)

    # Per-model calibration of log1p(length) on the out-of-fold score.
    key_pos = {k: i for i, k in enumerate(keys)}
    by_model: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in rows:
        zs, ys = by_model[r["model_canonical"]]
        zs.append(float(oof[key_pos[_prompt_key(r)]]))
        ys.append(math.log1p(float(r["response_tokens_cl100k"])))
    all_z = np.concatenate([np.asarray(v[0]) for v in by_model.values()])
    all_y = np.concatenate([np.asarray(v[1]) for v in by_model.values()])
    pooled_slope = float(np.cov(all_z, all_y)[0, 1] / (np.var(all_z) or 1.0))
    calibration: dict[str, list[float]] = {}
    resid_all = []
    for m in sorted(by_model):
        z = np.asarray(by_model[m][0])
        yy = np.asarray(by_model[m][1])
        dz = z - z.mean()
        lam = cfg.slope_shrink * float(np.var(all_z))
        slope = float((dz @ (yy - yy.mean()) + lam * pooled_slope) / (dz @ dz + lam))
        c = float(yy.mean() - slope * z.mean())
        resid = yy - (c + slope * z)
        resid_all.append(resid)
        q50, q90 = np.quantile(resid, [0.5, 0.9])
        calibration[m] = [round(c, 6), round(slope, 6), round(float(q50), 6), round(float(q90), 6)]
    pooled_c = float(all_y.mean() - pooled_slope * all_z.mean())
    pr = all_y - (pooled_c + pooled_slope * all_z)
    pq50, pq90 = np.quantile(pr, [0.5, 0.9])
    meta = {
        "format": FORMAT,
        "dim": cfg.dim,
        "y_mean": round(y_mean, 8),
        "knn_k": cfg.knn_k,
        "knn_beta": cfg.knn_beta,
        "config": cfg.__dict__,
        "train_prompts": n,
        "train_rows": len(rows),
        "calibration": calibration,
        "pooled_calibration": [
            round(pooled_c, 6),
            round(pooled_slope, 6),
            round(float(pq50), 6),
            round(float(pq90), 6),
        ],
    }
    arrays = {
        "idf": idf.astype(np.float32),
        "w": w.astype(np.float32),
        "s_mu": s_mu.astype(np.float32),
        "s_sd": s_sd.astype(np.float32),
        "s_w": s_w.astype(np.float32),
        "knn_y": y.astype(np.float32),
        "knn_rows": np.concatenate(kr).astype(np.int32),
        "knn_cols": np.concatenate(kc).astype(np.int32),
        "knn_vals": np.concatenate(kv).astype(np.float16),
    }
    assert len(s_mu) == NUM_STRUCT
    # Round-trip through the stored dtypes so the returned model equals a loaded one.
    return TextLengthModel(meta, {k: np.asarray(v) for k, v in arrays.items()})


def arrays_of(model: TextLengthModel) -> dict[str, np.ndarray]:
    return {
        "idf": model.idf.astype(np.float32),
        "w": model.w.astype(np.float32),
        "s_mu": model.s_mu.astype(np.float32),
        "s_sd": model.s_sd.astype(np.float32),
        "s_w": model.s_w.astype(np.float32),
        "knn_y": model.knn_y.astype(np.float32),
        "knn_rows": model.knn.rows.astype(np.int32),
        "knn_cols": model.knn.cols.astype(np.int32),
        "knn_vals": model.knn.vals.astype(np.float16),
    }


def save_model(model: TextLengthModel, out_dir: str | Path) -> Path:
    return artifact.save(out_dir, model.meta, arrays_of(model))
