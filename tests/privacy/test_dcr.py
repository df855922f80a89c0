"""DCR: soft clipping (Eq. 15), EMA teacher (Eq. 16), KD loss (Eq. 17-18), gradient flow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protofl.privacy.config import PrivacyConfig
from protofl.privacy.dcr import DCR, soft_clip


def make(seed: int = 0, **cfg: object) -> tuple[nn.Linear, nn.Linear, DCR]:
    torch.manual_seed(seed)
    adapter, head = nn.Linear(6, 8), nn.Linear(8, 5)
    return adapter, head, DCR(PrivacyConfig(clip=2.0, **cfg), head)  # type: ignore[arg-type]


def test_soft_clip_paper_and_min() -> None:
    r, gamma = 2.0, 0.05
    f = torch.randn(64, 8) * torch.logspace(-2, 2, 64).unsqueeze(1)
    out = soft_clip(f, r, gamma)
    norms = f.norm(dim=1)
    assert torch.allclose(out.norm(dim=1), r * norms / (norms + gamma * r), rtol=1e-5)
    assert (out.norm(dim=1) < r).all()
    assert out.norm(dim=1)[0] > norms[0]  # small features are expanded toward R (paper)
    m = soft_clip(f, r, gamma, mode="min")
    small = norms <= (1 - gamma) * r
    assert torch.allclose(m[small], f[small])  # identity below (1 - gamma) R
    assert (m.norm(dim=1) < r).all()
    with pytest.raises(ValueError, match="dcr_soft_clip"):
        soft_clip(f, r, gamma, mode="hard")


def test_kd_loss_value() -> None:
    adapter, head, dcr = make()
    x = torch.randn(16, 6)
    f_raw = adapter(x)
    logits = head(dcr.soft_clip(f_raw))
    with torch.no_grad():
        t = head(f_raw)  # teacher == head at start
    tau, lam = 4.0, 0.05
    p_t = F.softmax(t / tau, dim=1)
    manual = (p_t * (p_t.log() - F.log_softmax(logits / tau, dim=1))).sum(dim=1).mean()
    got = float(dcr.kd_loss(f_raw, logits).detach())
    assert got == pytest.approx(lam * tau**2 * float(manual.detach()), rel=1e-3)


def test_gradients_reach_adapter_and_student_only() -> None:
    adapter, head, dcr = make()
    with torch.no_grad():  # make the student differ from the teacher
        head.weight.add_(0.5 * torch.randn_like(head.weight))
    x, y = torch.randn(16, 6), torch.randint(0, 5, (16,))
    f_raw = adapter(x)
    logits = head(dcr.soft_clip(f_raw))
    kd = dcr.kd_loss(f_raw, logits)
    kd.backward(retain_graph=True)
    for p in (*adapter.parameters(), *head.parameters()):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0
    for p in dcr.teacher.parameters():
        assert p.grad is None and not p.requires_grad
    (F.cross_entropy(logits, y) + kd).backward()
    assert all(p.grad is None for p in dcr.teacher.parameters())


def test_teacher_follows_ema() -> None:
    adapter, head, dcr = make(dcr_beta=0.9)
    opt = torch.optim.SGD([*adapter.parameters(), *head.parameters()], lr=0.5)
    teacher_before = [p.detach().clone() for p in dcr.teacher.parameters()]
    x, y = torch.randn(16, 6), torch.randint(0, 5, (16,))
    f_raw = adapter(x)
    logits = head(dcr.soft_clip(f_raw))
    (F.cross_entropy(logits, y) + dcr.kd_loss(f_raw, logits)).backward()
    opt.step()
    dcr.after_step(head)
    for t_old, t_new, s in zip(teacher_before, dcr.teacher.parameters(), head.parameters()):
        assert torch.allclose(t_new, 0.9 * t_old + 0.1 * s.detach(), atol=1e-6)
        assert not torch.allclose(t_new, s)


def test_warmup_and_state() -> None:
    adapter, head, dcr = make(dcr_warmup_steps=2)
    f_raw = adapter(torch.randn(4, 6))
    assert float(dcr.kd_loss(f_raw, head(f_raw)).detach()) == 0.0
    with torch.no_grad():
        head.weight.add_(1.0)
    dcr.after_step(head)  # still warming up: teacher re-synced to the student
    assert torch.equal(dcr.teacher.weight, head.weight)
    dcr.after_step(head)
    assert dcr.active
    state = dcr.state_dict()
    _, _, dcr2 = make(seed=1)
    dcr2.load_state_dict(state)
    assert dcr2.steps == 2 and torch.equal(dcr2.teacher.weight, dcr.teacher.weight)
