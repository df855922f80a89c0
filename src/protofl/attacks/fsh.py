"""Feature-space hijacking (VPDR Appendix E.6.1): reconstruct inputs whose feature matches a
released prototype.

For every target prototype ``p*`` (one per class), ``samples_per_target`` dummy images
``x = 0.5 * (tanh(w) + 1)`` in [0, 1] are optimised jointly (one batch) with Adam on::

    L(x) = ||phi(x) - p*||^2 + lambda_TV * TV(x),
    TV(x) = sum over channels and pixels of |x[i+1, j] - x[i, j]| + |x[i, j+1] - x[i, j]|

(anisotropic total variation, summed, not averaged).  Defaults follow the paper: Adam lr 0.01,
lambda_TV 1e-3, early stopping with patience 300 and tolerance 1e-6 on the batch loss; the step cap
(``max_steps``) is an option (the paper allows 10,000; a CPU-friendly default is lower).  Each
reconstruction keeps the image with its lowest loss seen.

Metrics (``fsh_metrics``):

* ``cos_sim``: mean cosine similarity between phi(reconstruction) and its target prototype.
* ``cffd``: classifier-feature Frechet distance between the reconstructions' features of a class
  and the real features of that class, averaged over the attacked classes.  Gaussians with
  **diagonal** covariance are fitted (few reconstructions per class cannot support a full
  covariance): ``||m1 - m2||^2 + sum_j (s1_j + s2_j - 2 sqrt(s1_j s2_j))``.
* ``top1_hit``: fraction of reconstructions whose nearest *true* class prototype (the mean of the
  client's real features of each class) is the target class.  ``top1_hit_released`` uses the
  released (noisy) prototypes instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FeatureFn = Callable[[torch.Tensor], torch.Tensor]
"""Differentiable phi: float images [B, C, H, W] in [0, 1] -> features [B, d]."""


@dataclass
class FshResult:
    """Reconstructions (best image per dummy), their features, final losses and steps run."""

    images: torch.Tensor  # [K, S, C, H, W]
    features: torch.Tensor  # [K, S, d]
    target_classes: torch.Tensor  # [K]
    losses: torch.Tensor  # [K, S]
    steps: int


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV per image (summed over channels and pixels): [B, C, H, W] -> [B]."""
    dh = (x[:, :, 1:, :] - x[:, :, :-1, :]).abs().sum(dim=(1, 2, 3))
    dw = (x[:, :, :, 1:] - x[:, :, :, :-1]).abs().sum(dim=(1, 2, 3))
    return dh + dw


def hijack(
    phi: FeatureFn,
    targets: torch.Tensor,
    image_shape: tuple[int, int, int],
    *,
    target_classes: torch.Tensor | None = None,
    samples_per_target: int = 4,
    lr: float = 0.01,
    lambda_tv: float = 1e-3,
    max_steps: int = 1000,
    patience: int = 300,
    tol: float = 1e-6,
    init_std: float = 0.1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> FshResult:
    """Optimise ``samples_per_target`` images per target prototype (all in one batch).

    ``device``: where the optimisation runs (``phi`` must compute there); the initial images
    are drawn from ``generator`` on the CPU and moved, so a seed gives the same start on any
    device; the result is on the CPU."""
    if targets.ndim != 2:
        raise ValueError(f"targets must be [K, d], got {tuple(targets.shape)}")
    for name, value, low in (
        ("samples_per_target", samples_per_target, 1),
        ("max_steps", max_steps, 1),
        ("patience", patience, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is out of range; allowed: integers >= {low}")
    if not lr > 0:
        raise ValueError(f"lr={lr!r} is out of range; allowed: (0, inf)")
    if not lambda_tv >= 0:
        raise ValueError(f"lambda_tv={lambda_tv!r} is out of range; allowed: [0, inf)")
    k, d = targets.shape
    s = samples_per_target
    gen = generator or torch.Generator().manual_seed(0)
    dev = torch.device(device) if device is not None else targets.device
    goal = targets.detach().float().repeat_interleave(s, dim=0).to(dev)  # [K*S, d]
    w = (init_std * torch.randn((k * s, *image_shape), generator=gen)).to(dev)
    w.requires_grad_(True)
    opt = torch.optim.Adam([w], lr=lr)
    best_loss = torch.full((k * s,), math.inf, device=dev)
    best_x = torch.zeros((k * s, *image_shape), device=dev)
    run_best = math.inf
    since = 0
    step = 0
    with torch.enable_grad():
        for step in range(1, max_steps + 1):  # noqa: B007  (the last value is reported)
            x = 0.5 * (torch.tanh(w) + 1.0)
            feat = phi(x)
            per = ((feat - goal) ** 2).sum(dim=1) + lambda_tv * total_variation(x)
            with torch.no_grad():
                better = per < best_loss
                best_loss = torch.where(better, per.detach(), best_loss)
                best_x[better] = x.detach()[better]
            loss = per.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            batch_loss = float(per.detach().mean())
            if batch_loss < run_best - tol:
                run_best = batch_loss
                since = 0
            else:
                since += 1
                if since >= patience:
                    break
    with torch.no_grad():
        feats = phi(best_x).detach().cpu()
    best_x, best_loss = best_x.cpu(), best_loss.cpu()
    classes = (
        target_classes.detach().cpu().long()
        if target_classes is not None
        else torch.arange(k, dtype=torch.long)
    )
    return FshResult(
        images=best_x.view(k, s, *image_shape),
        features=feats.view(k, s, d),
        target_classes=classes,
        losses=best_loss.view(k, s),
        steps=step,
    )


def diagonal_frechet(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance of diagonal Gaussians fitted to the rows of ``a`` and ``b``."""
    m1, m2 = a.mean(axis=0), b.mean(axis=0)
    v1 = a.var(axis=0) if len(a) > 1 else np.zeros(a.shape[1])
    v2 = b.var(axis=0) if len(b) > 1 else np.zeros(b.shape[1])
    return float(((m1 - m2) ** 2).sum() + (v1 + v2 - 2.0 * np.sqrt(v1 * v2)).sum())


def fsh_metrics(
    result: FshResult,
    targets: torch.Tensor,
    real_features: torch.Tensor,
    real_labels: torch.Tensor,
    *,
    released: torch.Tensor | None = None,
    released_classes: torch.Tensor | None = None,
) -> dict[str, float]:
    """cos_sim, cffd (diagonal), top1_hit (true class means) and top1_hit_released."""
    k, s, d = result.features.shape
    feats = result.features.reshape(k * s, d).double()
    goal = targets.detach().double().repeat_interleave(s, dim=0)
    cos = torch.nn.functional.cosine_similarity(feats, goal, dim=1)
    rf = real_features.detach().double()
    ry = real_labels.detach().long()
    present = torch.unique(ry)
    means = torch.stack([rf[ry == c].mean(dim=0) for c in present])
    want = result.target_classes.repeat_interleave(s)
    nearest = present[torch.cdist(feats, means).argmin(dim=1)]
    out = {
        "cos_sim": float(cos.mean()),
        "top1_hit": float((nearest == want).double().mean()),
    }
    ffd = []
    rf_np, ry_np = rf.numpy(), ry.numpy()
    for i, c in enumerate(result.target_classes.tolist()):
        real_c = rf_np[ry_np == c]
        if len(real_c):
            ffd.append(diagonal_frechet(result.features[i].double().numpy(), real_c))
    out["cffd"] = float(np.mean(ffd)) if ffd else math.nan
    if released is not None and released_classes is not None:
        rel_cls = released_classes.detach().long()
        near = rel_cls[torch.cdist(feats, released.detach().double()).argmin(dim=1)]
        out["top1_hit_released"] = float((near == want).double().mean())
    out["steps"] = float(result.steps)
    out["targets"] = float(k)
    out["reconstructions"] = float(k * s)
    return out


def save_grid(
    path: Path,
    result: FshResult,
    real_means: torch.Tensor,
    *,
    labels: list[str] | None = None,
    scale: int = 4,
) -> Path:
    """PNG: one row per target class, the real class-mean image then its reconstructions."""
    from PIL import Image, ImageDraw

    k, s, _, h, w = result.images.shape
    pad = 2
    label_w = 40 if labels else 0
    cell_h, cell_w = h * scale, w * scale
    canvas = Image.new(
        "RGB", (label_w + (s + 1) * (cell_w + pad) + pad, k * (cell_h + pad) + pad), "white"
    )
    draw = ImageDraw.Draw(canvas)

    def tile(img: torch.Tensor) -> Image.Image:
        arr = img.detach().clamp(0, 1).cpu()
        if arr.shape[0] == 1:
            arr = arr.expand(3, -1, -1)
        data = (arr.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        return Image.fromarray(data).resize((cell_w, cell_h), Image.Resampling.NEAREST)

    for i in range(k):
        y = pad + i * (cell_h + pad)
        if labels:
            draw.text((2, y + cell_h // 2 - 5), labels[i], fill="black")
        canvas.paste(tile(real_means[i]), (label_w + pad, y))
        for j in range(s):
            canvas.paste(tile(result.images[i, j]), (label_w + pad + (j + 1) * (cell_w + pad), y))
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path


def one_target_per_class(
    prototypes: torch.Tensor, classes: torch.Tensor, max_classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first released prototype of each class (up to ``max_classes`` classes)."""
    seen: dict[int, int] = {}
    for i, c in enumerate(classes.tolist()):
        if c not in seen and len(seen) < max_classes:
            seen[c] = i
    rows = torch.tensor(list(seen.values()), dtype=torch.long)
    return prototypes[rows], classes[rows]


def hijack_release(
    phi: FeatureFn,
    release: Any,
    image_shape: tuple[int, int, int],
    real_features: torch.Tensor,
    real_labels: torch.Tensor,
    *,
    max_classes: int = 10,
    **kwargs: Any,
) -> tuple[FshResult, dict[str, float]]:
    """Attack one release (``Release`` or saved dict): one target per class; returns the result
    and its metrics."""
    protos = release["prototypes"] if isinstance(release, dict) else release.prototypes
    classes = release["classes"] if isinstance(release, dict) else release.classes
    protos = protos.detach().float()
    targets, target_classes = one_target_per_class(protos, classes, max_classes)
    result = hijack(phi, targets, image_shape, target_classes=target_classes, **kwargs)
    metrics = fsh_metrics(
        result,
        targets,
        real_features,
        real_labels,
        released=protos,
        released_classes=classes,
    )
    return result, metrics


def fsh_on_run(
    run_dir: Any,
    *,
    round_: int | None = None,
    clients: list[str] | None = None,
    max_classes: int = 10,
    samples_per_target: int = 2,
    max_steps: int = 300,
    patience: int = 300,
    tol: float = 1e-6,
    lr: float = 0.01,
    lambda_tv: float = 1e-3,
    seed: int = 0,
    threads: int | None = 1,
    home: Any = None,
    write: bool = True,
    device: str | None = None,
) -> dict[str, Any]:
    """Hijack every (or the named) client's release of round ``round_`` (1-based, default the
    last) of a saved run; writes ``attack_fsh.json`` and one PNG grid per client
    (``attack_fsh_<client>.png``: real class-mean image, then the reconstructions).

    ``threads``: torch intra-op threads while attacking (1 by default: the batch is small, and
    more threads were measured up to 10x slower per step on a loaded 2-core machine).
    ``device``: where the optimisation runs (default: the run's ``run.device``, resolved on
    this machine); the reconstructions start from the same CPU draws on any device.
    """
    import json
    import re

    from protofl.attacks.artifacts import json_safe, load_run, rebuild_clients, run_facts
    from protofl.attacks.mia import mean_metrics
    from protofl.models.device import prepare_device

    art = load_run(run_dir)
    dev = prepare_device(device or art.config.run.device)
    r = art.rounds if round_ is None else round_
    targets = [art.client_index(n) for n in clients] if clients else range(len(art.clients))
    releases = {i: art.release(r, i) for i in targets}  # validates round and clients first
    per_client: dict[str, dict[str, float]] = {}
    images: dict[str, str] = {}
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for view in rebuild_clients(art, clients, home=Path(home) if home else None, round_=r):
            if view.train_images.ndim != 4:
                raise ValueError(
                    "feature-space hijacking needs image inputs; data set "
                    f"{art.config.data.name!r} is not an image data set"
                )
            gen = torch.Generator().manual_seed(seed * 1_000_003 + view.index)
            view.to(dev)
            result, metrics = hijack_release(
                view.phi_images,
                releases[view.index],
                view.image_shape,
                view.phi_z(view.train_z),
                view.train_labels,
                max_classes=max_classes,
                samples_per_target=samples_per_target,
                max_steps=max_steps,
                patience=patience,
                tol=tol,
                lr=lr,
                lambda_tv=lambda_tv,
                generator=gen,
                device=dev,
            )
            per_client[view.name] = metrics
            if write:
                real = view.backbone.preprocess(view.train_images)
                means = torch.stack(
                    [
                        real[view.train_labels == c].mean(dim=0)
                        if bool((view.train_labels == c).any())
                        else torch.zeros(view.image_shape)
                        for c in result.target_classes.tolist()
                    ]
                )
                safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", view.name)
                png = art.run_dir / f"attack_fsh_{safe}.png"
                save_grid(
                    png,
                    result,
                    means,
                    labels=[view.class_names[c] for c in result.target_classes.tolist()],
                )
                images[view.name] = png.name
    finally:
        torch.set_num_threads(threads_before)
    out: dict[str, Any] = {
        "attack": "fsh",
        **run_facts(art, r),
        "settings": {
            "samples_per_target": samples_per_target,
            "max_steps": max_steps,
            "patience": patience,
            "tol": tol,
            "lr": lr,
            "lambda_tv": lambda_tv,
            "max_classes": max_classes,
            "seed": seed,
            "device": str(dev),
            "cffd": "diagonal-covariance Frechet distance, mean over attacked classes",
            "top1_hit": "nearest true class mean of the client's real features",
        },
        "clients": per_client,
        "mean": mean_metrics(per_client),
        "images": images,
    }
    if write:
        (art.run_dir / "attack_fsh.json").write_text(json.dumps(json_safe(out), indent=2) + "\n")
    return out
