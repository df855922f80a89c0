"""Feature-norm statistics of a client's features (a local-only diagnostic the engine records each
round, VPDR Fig. 4a; numpy only, no plotting: :mod:`protofl.report.plots` draws them)."""

from __future__ import annotations

from typing import Any

import numpy as np

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def feature_norm_stats(features: Any, clip: float | None = None) -> dict[str, float]:
    """L2 norms of feature rows [n, d] -> n, mean, std, min, q05..q95, max (and, with ``clip``,
    the fraction of rows whose norm exceeds it).  JSON-safe floats; for ``metrics.jsonl``."""
    arr = features.detach().cpu().numpy() if hasattr(features, "detach") else np.asarray(features)
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"features must be [n, d], got shape {arr.shape}")
    norms = np.linalg.norm(arr, axis=1)
    norms = norms[np.isfinite(norms)]
    out: dict[str, float] = {"n": float(len(norms))}
    if len(norms) == 0:
        return out
    out.update(
        {
            "mean": float(norms.mean()),
            "std": float(norms.std()),
            "min": float(norms.min()),
            "max": float(norms.max()),
        }
    )
    for q, v in zip(QUANTILES, np.quantile(norms, QUANTILES)):
        out[f"q{round(100 * q):02d}"] = float(v)
    if clip is not None:
        out["frac_above_clip"] = float((norms > clip).mean())
    return out
