"""Kernels of batched training (:mod:`protofl.engine.batched` trains with them): linear layers
over a group of clients whose weight gradients land in preallocated buffers, and the optimiser
steps (AdamW, SGD, gradient clipping, DCR's EMA teacher) applied to the stacked rows of many
clients at once, each with its own step counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from protofl.engine.store import _runs
from protofl.privacy.dcr import ema_


# --------------------------------------------------------------------------------------------
# batched linear layers whose weight gradients land in preallocated buffers
# --------------------------------------------------------------------------------------------
class _BatchedLinear(torch.autograd.Function):
    """``x @ w^T + b`` for k clients at once: ``[k, n, i]``, ``[k, o, i]`` -> ``[k, n, o]``.

    The weight and bias gradients are written into the buffers ``gw`` ``[k, o, i]`` and ``gb``
    ``[k, o]`` (the layout of the parameters, so no transposed copies and no fresh allocation per
    step) instead of being returned.  ``anchor`` is a scalar leaf that requires grad, so the
    backward also runs for the first layer, whose input needs no gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        gw: torch.Tensor | None,
        gb: torch.Tensor | None,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.sinks = (gw, gb)
        wt = w.transpose(1, 2)
        return torch.bmm(x, wt) if b is None else torch.baddbmm(b.unsqueeze(1), x, wt)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        gw, gb = ctx.sinks
        if gw is not None:
            torch.bmm(grad.transpose(1, 2), x, out=gw)
        if gb is not None:
            torch.sum(grad, dim=1, out=gb)
        gx = torch.bmm(grad, w) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None


class _ProjectedAdapter(torch.autograd.Function):
    """``y0 + h (P U)^T`` for k clients: the frozen projection ``P`` of the adapted input
    ``z + U h``, re-associated, with ``y0 = proj(z)`` computed beforehand and ``pu = P U``
    [k, d, H].  The gradient of the up-projection ``U``, ``P^T (g^T h)``, is written into the
    buffer ``gu`` [k, d_in, H] (as :class:`_BatchedLinear` does); ``h`` gets ``g (P U)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        y0: torch.Tensor,
        pu: torch.Tensor,
        gu: torch.Tensor | None,
        grad_up: Any,
        anchor: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(h, pu)
        ctx.sink = (gu, grad_up)
        return torch.baddbmm(y0, h, pu.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        h, pu = ctx.saved_tensors
        gu, grad_up = ctx.sink
        if gu is not None:
            grad_up(torch.bmm(grad.transpose(1, 2), h), gu)
        gh = torch.bmm(grad, pu) if ctx.needs_input_grad[0] else None
        return gh, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# optimiser steps on stacked rows (each client's own hyper-parameters, one tensor program)
# --------------------------------------------------------------------------------------------
def adamw_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """The update of torch's default (single-tensor) AdamW, op for op, on tensors that each
    hold one or more clients sharing one (already incremented) step count."""
    for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        step = float(st)
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)


def adamw_rows(
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    exp_avg: dict[str, torch.Tensor],
    exp_avg_sq: dict[str, torch.Tensor],
    steps: dict[str, torch.Tensor],
    k: int,
    *,
    names: Sequence[str],
    head_names: Sequence[str],
    group: Mapping[str, Any],
    fused: bool,
    head_live: torch.Tensor | None = None,
) -> None:
    """torch's fused AdamW (``fused``; else :func:`adamw_reference`) with the hyper-parameters
    of the optimiser param ``group``, on rows 0..k-1 of the tensors ``names``, one tensor per
    run of equal step counts; with ``head_live`` the rows of ``head_names`` of the other
    clients take no step (no gradient)."""
    beta1, beta2 = (float(b) for b in group["betas"])
    sets: list[tuple[list[str], list[bool] | None]] = [(list(names), None)]
    if head_live is not None:
        body = [n for n in names if n not in head_names]
        sets = [(body, None), (list(head_names), head_live.tolist())]
    ps, gs, ms, vs, ss = [], [], [], [], []
    for names, live in sets:
        if not names:
            continue
        for a, b in _runs(steps[names[0]][:k].tolist(), live):
            for n in names:
                ps.append(params[n][a:b])
                gs.append(grads[n][a:b])
                ms.append(exp_avg[n][a:b])
                vs.append(exp_avg_sq[n][a:b])
                ss.append(steps[n][a])
    if not ps:
        return
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    if fused:
        torch._fused_adamw_(
            ps,
            gs,
            ms,
            vs,
            [],
            ss,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
    else:
        adamw_reference(
            ps, gs, ms, vs, ss, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps
        )


def clip_rows(
    grads: dict[str, torch.Tensor], k: int, *, names: Sequence[str], max_norm: float
) -> None:
    """torch.nn.utils.clip_grad_norm_ per client (rows 0..k-1): each client's gradient
    scaled by min(1, max_norm / (its global L2 norm + 1e-6))."""
    sq = sum(grads[n][:k].flatten(1).float().pow(2).sum(1) for n in names)
    coef = (max_norm / (torch.as_tensor(sq).sqrt() + 1e-6)).clamp(max=1.0)
    for n in names:
        g = grads[n][:k]
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))


def sgd_rows(
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    bufs: dict[str, torch.Tensor],
    k: int,
    *,
    names: Sequence[str],
    head_names: Sequence[str],
    group: Mapping[str, Any],
    head_live: torch.Tensor | None = None,
) -> None:
    """torch's single-tensor SGD (dampening 0) with the hyper-parameters of the param
    ``group``, on rows 0..k-1, op for op; with ``head_live`` the rows of ``head_names`` of the
    other clients take no step (no gradient)."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    momentum, nesterov = float(group["momentum"]), bool(group["nesterov"])
    live = head_live.tolist() if head_live is not None else None
    for n in names:
        spans = [(0, k)]
        if live is not None and n in head_names:
            spans = _runs([0] * k, live)
        for a, b in spans:
            p, g = params[n][a:b], grads[n][a:b]
            if wd != 0.0:
                g = g.add(p, alpha=wd)
            if momentum != 0.0:
                buf = bufs[n][a:b]
                buf.mul_(momentum).add_(g, alpha=1.0)
                g = g.add(buf, alpha=momentum) if nesterov else buf
            p.add_(g, alpha=-lr)


def ema_rows(
    teacher: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    dcr_steps: torch.Tensor,
    k: int,
    warmup: int,
    beta: float,
) -> None:
    """DCR.after_step on rows 0..k-1 (counters already advanced): copy during warm-up,
    else theta_t <- beta*theta_t + (1-beta)*theta_s."""
    sync = (dcr_steps[:k] <= warmup).tolist()
    for n, t in teacher.items():
        s = params["head." + n][:k]
        if not any(sync):
            ema_(t[:k], s, beta)
            continue
        for i in range(k):
            if sync[i]:
                t[i].copy_(s[i])
            else:
                ema_(t[i], s[i], beta)
