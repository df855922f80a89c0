"""FedProto in a plain PyTorch loop, with VPDR added through ``PrototypePrivacy``.

Three clients, each from its own "domain" (a shifted, rescaled copy of four Gaussian classes),
train a small adapter and classifier on their own data; the server averages their class
prototypes and sends them back; each client pulls its features towards the global prototype of
their class (FedProto's loss: CE + lam * MSE).  The lines marked ``# VPDR`` are all it takes to
make every upload (epsilon, delta)-local-DP and to add DCR to local training.

    python examples/plain_pytorch_fedproto.py            # about 10 s on two cores
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from protofl.privacy import PrototypePrivacy

ROUNDS, EPOCHS, CLASSES, DIM, FEAT = 10, 2, 4, 16, 8
torch.manual_seed(0)  # this example's own data and models; the privacy noise is secret


def make_client(domain: int, n: int = 400) -> tuple[torch.Tensor, ...]:
    """One domain: class means shared by all domains, a per-domain shift and scale."""
    g = torch.Generator().manual_seed(100 + domain)
    means = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(7)) * 1.2
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = means[y] + torch.randn(n, DIM, generator=g)
    x = x * (1.0 + 0.5 * domain) + domain  # domain shift
    split = int(0.75 * n)
    return x[:split], y[:split], x[split:], y[split:]


clients = [make_client(d) for d in range(3)]
adapters = [nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, FEAT)) for _ in clients]
heads = [nn.Linear(FEAT, CLASSES) for _ in clients]
optims = [
    torch.optim.Adam([*a.parameters(), *h.parameters()], lr=1e-2) for a, h in zip(adapters, heads)
]

# VPDR: one PrototypePrivacy per client, calibrated once for all ROUNDS uploads.
privacy = [
    PrototypePrivacy(epsilon=4.0, delta=1e-5, rounds=ROUNDS, dim=FEAT, clip=1.0, name=f"c{i}")
    for i in range(len(clients))
]
dcrs = [p.dcr(h) for p, h in zip(privacy, heads)]  # VPDR: DCR hooks (None without DCR)

global_protos: torch.Tensor | None = None
for _ in range(ROUNDS):
    uploads = []
    for i, (x, y, _, _) in enumerate(clients):
        # ----- local training (FedProto: CE + lam * ||f - global prototype of y||^2) -----
        for _ in range(EPOCHS):
            for idx in torch.randperm(len(y)).split(32):
                f_raw = adapters[i](x[idx])
                f = dcrs[i].soft_clip(f_raw) if dcrs[i] else f_raw  # VPDR: soft clipping
                logits = heads[i](f)
                loss = F.cross_entropy(logits, y[idx])
                if global_protos is not None:
                    loss = loss + 1.0 * F.mse_loss(f, global_protos[y[idx]])
                if dcrs[i]:
                    loss = loss + dcrs[i].kd_loss(f_raw, logits)  # VPDR: EMA-teacher distillation
                optims[i].zero_grad()
                loss.backward()
                optims[i].step()
                if dcrs[i]:
                    dcrs[i].after_step(heads[i])  # VPDR: EMA teacher update
        # ----- upload: noisy class prototypes instead of the exact means -----
        with torch.no_grad():
            feats = adapters[i](x)
        release = privacy[i].release(feats, y, num_classes=CLASSES)  # VPDR: clip, mean, noise
        uploads.append(release)
    # ----- server: count-weighted mean of the uploaded prototypes per class -----
    sums = torch.zeros(CLASSES, FEAT)
    counts = torch.zeros(CLASSES)
    for r in uploads:
        sums.index_add_(0, r.classes, r.prototypes * r.counts[:, None].float())
        counts.index_add_(0, r.classes, r.counts.float())
    global_protos = sums / counts.clamp_min(1.0)[:, None]

accs = []
for i, (_, _, xt, yt) in enumerate(clients):
    with torch.no_grad():
        f = adapters[i](xt)
        f = dcrs[i].soft_clip(f) if dcrs[i] else f
        accs.append(float((heads[i](f).argmax(1) == yt).float().mean()))
print("accuracy per client:", " ".join(f"{a:.3f}" for a in accs))
print(f"epsilon spent per client: {max(p.epsilon_spent() for p in privacy):.4f} (delta 1e-05)")
print("guarantee:", privacy[0].guarantee()["statement"])
