"""``copy_client_model``: a copy of a fresh client model equals ``copy.deepcopy``'s, owns its
trainable tensors and bookkeeping, and shares the template's frozen parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from protofl.config import BackboneConfig
from protofl.models.client import build_client_model, copy_client_model


@pytest.mark.parametrize("train_projection", [True, False])
@pytest.mark.parametrize("head", ["linear", "mlp"])
def test_a_copy_is_a_deepcopy_sharing_only_the_frozen_parameters(
    train_projection: bool, head: str
) -> None:
    cfg = BackboneConfig(train_projection=train_projection, head=head)
    template = build_client_model(40, 5, cfg, torch.Generator().manual_seed(3))
    deep, fast = copy.deepcopy(template), copy_client_model(template)
    assert type(fast) is type(template) and repr(fast) == repr(deep)
    assert fast.state_dict().keys() == deep.state_dict().keys()
    for k, v in fast.state_dict().items():
        assert torch.equal(v, deep.state_dict()[k]), k
    ours = dict(template.named_parameters())
    for name, p in fast.named_parameters():
        assert type(p) is type(ours[name]) and p.requires_grad == ours[name].requires_grad
        # frozen: the template's tensor itself; trainable: storage of its own
        assert (p is ours[name]) == (not p.requires_grad), name
    for mod, original in zip(fast.modules(), template.modules(), strict=True):
        assert mod is not original and mod._forward_hooks is not original._forward_hooks
        assert mod.training == original.training
    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fast(z)[1], template(z)[1])
    # training the copy leaves the template (and every other copy) as it was
    other = copy_client_model(template)
    opt = torch.optim.SGD(fast.trainable_parameters(), lr=0.5)
    fast(z)[1].sum().backward()
    opt.step()
    fast.register_forward_hook(lambda *_: None)
    assert not template._forward_hooks and not other._forward_hooks
    assert not torch.equal(fast(z)[1], template(z)[1])
    assert torch.equal(other(z)[1], template(z)[1])
    assert all(p.grad is None for p in template.parameters())


def test_a_tied_parameter_stays_tied_in_the_copy() -> None:
    model = build_client_model(8, 8, BackboneConfig(proto_dim=8), torch.Generator().manual_seed(0))
    model.head.weight = model.proj.weight
    fast = copy_client_model(model)
    assert fast.head.weight is fast.proj.weight and fast.proj.weight is not model.proj.weight
