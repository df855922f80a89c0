"""MPFT: distillation and teacher logits by hand, the server model."""

from __future__ import annotations

import math

import pytest
import torch

from protofl.methods.mpft import ServerDistillation, teacher_logits
from protofl.methods.objectives import Step
from tests.methods.helpers import (
    make,
    upload,
)


def test_distillation_term_by_hand() -> None:
    """beta * T^2 * KL(softmax(t/T) || softmax(s/T)) with the teacher on the raw feature."""
    t = 2.0
    gs = {"mpft.head.weight": torch.eye(2), "mpft.head.bias": torch.zeros(2)}
    term = ServerDistillation(beta=0.5, temperature=t, use_adapter=False, source="feature")
    f_raw = torch.tensor([[[t * math.log(3.0), 0.0]]])  # teacher: softmax(f / T) = (3/4, 1/4)
    ok = torch.ones(1, 1, dtype=torch.bool)

    def value(student: torch.Tensor) -> float:
        step = Step(f=f_raw, logits=student, y=torch.zeros(1, 1, dtype=torch.long), ok=ok)
        step.f_raw = f_raw
        return float(term.value(step, term.prepare(gs, None), slice(0, 1))[0])  # type: ignore[arg-type]

    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert value(torch.zeros(1, 1, 2)) == pytest.approx(0.5 * t * t * kl, rel=1e-5)  # (1/2, 1/2)
    assert value(f_raw) == pytest.approx(0.0, abs=1e-6)
    # nothing before the server model is broadcast
    assert term.prepare({}, None) is None  # type: ignore[arg-type]


def test_teacher_logits_by_hand() -> None:
    gs = {
        "mpft.adapter.down.weight": torch.tensor([[1.0, 0.0]]),  # hidden 1
        "mpft.adapter.up.weight": torch.tensor([[0.0], [2.0]]),
        "mpft.head.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        "mpft.head.bias": torch.tensor([0.5, 0.0]),
    }
    u = torch.tensor([[3.0, 1.0]])
    # adapter: u + up(relu(down u)) = (3, 1) + (0, 6) = (3, 7)
    assert teacher_logits(u, gs, use_adapter=True).tolist() == [[3.5, 7.0]]
    assert teacher_logits(u, gs, use_adapter=False).tolist() == [[3.5, 1.0]]


def test_mpft_server_learns_released_prototypes() -> None:
    m = make("mpft", {"server_epochs": 200, "server_lr": 0.05}, num_classes=2, dim=4)
    ups = [
        upload(0, 0, [[2.0, 0, 0, 0], [0, 2.0, 0, 0]], [0, 1]),
        upload(1, 1, [[2.0, 0.2, 0, 0], [0.2, 2.0, 0, 0]], [0, 1]),
    ]
    gs = m.aggregate(ups, 0)
    x = torch.cat([u.release.prototypes for u in ups if u.release is not None])
    assert teacher_logits(x, gs, use_adapter=True).argmax(1).tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="teacher"):
        make("mpft", {"teacher": "ensemble"})
