"""Autograd kernels of batched training: linear layers over a group of clients whose weight
gradients land in preallocated buffers (:mod:`protofl.engine.batched` trains with them)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# Working memory (bytes) one group of clients may use for weight gradients and activations;


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
