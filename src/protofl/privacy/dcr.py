"""Distillation-guided Clipping Regularization (VPDR Sec. 4.3): local training only, no budget.

Usage in a local step::

    f_raw = adapter(backbone(x))
    f = dcr.soft_clip(f_raw)                 # VPDR Eq. (15)
    logits = head(f)                          # the student
    loss = base_loss + dcr.kd_loss(f_raw, logits)   # lambda1 * L_KD, Eq. (17)-(18)
    loss.backward(); optimizer.step()
    dcr.after_step(head)                      # EMA teacher update, Eq. (16)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protofl.privacy.config import PrivacyConfig


def soft_clip(
    features: torch.Tensor, radius: float | torch.Tensor, gamma: float, mode: str = "paper"
) -> torch.Tensor:
    """paper: z_hat = R / (||z|| + gamma*R) * z (VPDR Eq. (15); expands small, contracts large);
    min: the reference code's z * min(1, R / (||z|| + gamma*R)) (identity below (1-gamma)R).
    ``radius``: a number, or a tensor that broadcasts against ``features``' norms (one R per
    client of a fused group)."""
    norms = features.norm(dim=-1, keepdim=True)
    scale = radius / (norms + gamma * radius)
    if mode == "min":
        scale = torch.clamp(scale, max=1.0)
    elif mode != "paper":
        raise ValueError(f"dcr_soft_clip={mode!r} is unknown; choose one of: paper, min")
    return features * scale


def distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float, ok: torch.Tensor
) -> torch.Tensor:
    """Per client ``KL(softmax(y_t/tau) || softmax(y_s/tau))``, the mean over its valid rows
    (VPDR Eq. (17)); logits [k, b, C], ``ok`` [k, b] -> [k].  The batchmean of one client is
    this kernel with k = 1."""
    log_p_s = F.log_softmax(student_logits / tau, dim=-1)
    log_p_t = F.log_softmax(teacher_logits.to(student_logits.dtype) / tau, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=-1)
    okf = ok.to(kl.dtype)
    return (kl * okf).sum(dim=1) / okf.sum(dim=1)


def ema_(teacher: torch.Tensor, student: torch.Tensor, beta: float) -> None:
    """In place, theta_t <- beta*theta_t + (1-beta)*theta_s (VPDR Eq. (16))."""
    teacher.mul_(beta).add_(student.detach().to(teacher.dtype), alpha=1.0 - beta)


class DCR:
    """Soft clipping, an EMA teacher copy of the classifier head and the temperature-scaled KD loss.

    The teacher starts as a copy of ``head`` and is frozen (no grad); it sees the RAW features and
    follows the student by theta_t <- beta*theta_t + (1-beta)*theta_s after each optimiser step.
    With ``dcr_warmup_steps > 0`` the KD loss is zero and the teacher is re-synced to the student
    for that many steps (the reference code's warm-up, counted once per run).
    """

    def __init__(self, config: PrivacyConfig, head: nn.Module) -> None:
        self.config = config
        self.radius = config.clip
        self.gamma = config.dcr_gamma
        self.beta = config.dcr_beta
        self.tau = config.dcr_tau
        self.weight = config.dcr_weight
        self.mode = config.dcr_soft_clip
        self.warmup = config.dcr_warmup_steps
        self.steps = 0
        self.teacher = copy.deepcopy(head)
        self.teacher.requires_grad_(False)
        self.teacher.eval()

    @property
    def active(self) -> bool:
        """Whether the warm-up is over (KD and EMA on)."""
        return self.steps >= self.warmup

    def soft_clip(self, features: torch.Tensor) -> torch.Tensor:
        """VPDR Eq. (15) (or the ``min`` variant); differentiable."""
        return soft_clip(features, self.radius, self.gamma, self.mode)

    def teacher_logits(self, f_raw: torch.Tensor) -> torch.Tensor:
        """Teacher predictions on the raw (unclipped) features, without gradient."""
        with torch.no_grad():
            return self.teacher(f_raw.detach())

    def kd_loss(self, f_raw: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
        """lambda1 * tau^2 * KL(softmax(y_t/tau) || softmax(y_s/tau)), batchmean (Eq. (17)-(18))."""
        if not self.active or self.weight == 0:
            return student_logits.sum() * 0.0
        y_t = self.teacher_logits(f_raw)
        ok = torch.ones(1, student_logits.shape[0], dtype=torch.bool)
        kl = distillation(student_logits.unsqueeze(0), y_t.unsqueeze(0), self.tau, ok)[0]
        return self.weight * self.tau**2 * kl  # Eq. (18): lambda1 * L_KD

    @torch.no_grad()
    def after_step(self, head: nn.Module) -> None:
        """EMA update theta_t <- beta*theta_t + (1-beta)*theta_s (Eq. (16)); buffers copied."""
        self.steps += 1
        if self.steps <= self.warmup:
            self.teacher.load_state_dict(head.state_dict())
            return
        for p_t, p_s in zip(self.teacher.parameters(), head.parameters(), strict=True):
            ema_(p_t, p_s, self.beta)
        for b_t, b_s in zip(self.teacher.buffers(), head.buffers(), strict=True):
            b_t.copy_(b_s)

    def state_dict(self) -> dict[str, Any]:
        """Teacher weights and the step counter."""
        return {"teacher": self.teacher.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.teacher.load_state_dict(state["teacher"])
        self.steps = int(state["steps"])
