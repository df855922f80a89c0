"""Server-side upload validation, shared by every engine (simulator and Flower strategy).

``validate_upload`` returns None for a valid upload or a one-line reason. It never raises on
malformed input: anything it cannot read is itself a reason to reject.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from protofl.methods.base import Upload

NormBound = Callable[[int], float | None]


def validate_upload(
    upload: Any,
    *,
    declared_domain: int | None,
    num_classes: int,
    dim: int,
    norm_bound: NormBound | None = None,
    one_per_class: bool = False,
) -> str | None:
    """Check one upload; None if valid, else the reason it is rejected.

    ``one_per_class``: the method releases class means (not clusters), so an upload holds at
    most one prototype per class (a hostile client cannot add weight with extra rows)."""
    try:
        return _validate(upload, declared_domain, num_classes, dim, norm_bound, one_per_class)
    except Exception as exc:  # a hostile upload must never crash the server
        return f"unreadable upload ({type(exc).__name__}: {exc})"


def _validate(
    upload: Any,
    declared_domain: int | None,
    num_classes: int,
    dim: int,
    norm_bound: NormBound | None,
    one_per_class: bool,
) -> str | None:
    if not isinstance(upload, Upload):
        return f"not an Upload but {type(upload).__name__}"
    if declared_domain is not None and upload.domain != declared_domain:
        return (
            f"domain {upload.domain!r} is not the one declared for this client ({declared_domain})"
        )
    if not isinstance(upload.num_samples, int) or upload.num_samples < 0:
        return f"num_samples {upload.num_samples!r} is not a non-negative integer"
    if upload.weights is not None:
        for key, value in upload.weights.items():
            if not isinstance(value, torch.Tensor) or not torch.isfinite(value).all():
                return f"weight {key!r} is not a finite tensor"
    for key, value in getattr(upload, "extras", {}).items():
        if not isinstance(value, torch.Tensor) or not torch.isfinite(value).all():
            return f"extra upload {key!r} is not a finite tensor"
    r = upload.release
    if r is None:
        return None
    tensors = {
        "prototypes": r.prototypes,
        "classes": r.classes,
        "counts": r.counts,
        "sensitivity": r.sensitivity,
        "noise_std": r.noise_std,
    }
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            return f"{name} is not a tensor"
    k = r.prototypes.shape[0] if r.prototypes.dim() == 2 else -1
    if r.prototypes.dim() != 2 or r.prototypes.shape[1] != dim:
        return f"prototypes have shape {tuple(r.prototypes.shape)}, expected [K, {dim}]"
    for name in ("classes", "counts"):
        if tensors[name].shape != (k,):
            return f"{name} has shape {tuple(tensors[name].shape)}, expected ({k},)"
    if r.prototypes.dtype.is_complex or not r.prototypes.dtype.is_floating_point:
        return f"prototypes have dtype {r.prototypes.dtype}, expected a float type"
    if not torch.isfinite(r.prototypes).all():
        return "prototypes hold NaN or inf"
    if r.classes.dtype.is_floating_point or r.counts.dtype.is_floating_point:
        return "classes and counts must be integer tensors"
    if k and (int(r.classes.min()) < 0 or int(r.classes.max()) >= num_classes):
        return f"class ids outside 0..{num_classes - 1}: {sorted(set(r.classes.tolist()))}"
    if k and int(r.counts.min()) < 1:
        return "a prototype claims fewer than one sample"
    if one_per_class and k and len(set(r.classes.tolist())) != k:
        return f"{k} prototype rows for {len(set(r.classes.tolist()))} classes; one per class"
    total = int(r.counts.sum()) if k else 0
    if total > upload.num_samples:
        return f"counts sum to {total}, more than the client's {upload.num_samples} samples"
    if norm_bound is not None and k:
        norms = r.prototypes.double().norm(dim=1)
        for i in range(k):
            bound = norm_bound(int(r.counts[i]))
            if bound is not None and float(norms[i]) > bound:
                return (
                    f"prototype {i} (class {int(r.classes[i])}) has norm {float(norms[i]):.3g}, "
                    f"impossible under the declared clipping and noise (bound {bound:.3g})"
                )
    return None
