"""FedDAP (Le et al., CVPR 2026): domain-aware prototypes with dual prototype alignment.

Each client releases its class prototypes (FedDAP Eq. 3) and reports its domain with the upload.
The server builds one global prototype per (class, domain) pair by cosine-similarity-weighted
fusion of the prototypes of that class from the clients of that domain (Eq. 4-5). Clients train
with ``CE + lambda1 * L_DPA + lambda2 * L_CPCL`` (Eq. 10): L_DPA pulls each feature towards its
class's prototype of the client's own domain (Eq. 6); L_CPCL is an InfoNCE over the prototypes of
the *other* domains, positives of the same class, negatives of the other classes (Eq. 7-8).

As in the paper, the trainable weights are FedAvg-averaged after each round (``shares_weights``);
``personalized: true`` turns averaging off so that only prototypes leave a client and the run is
covered by the prototype LDP guarantee (FedDAP under VPDR's setting).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from protofl.methods.base import METHOD_REGISTRY, Batch, ClientState, GlobalState, Method, Upload
from protofl.models.client import ClientModel


def fusion_weights(protos: torch.Tensor, tau: float) -> torch.Tensor:
    """FedDAP Eq. (4): ``alpha = softmax_j(S_j / tau)``, ``S_j = sum_{k != j} cos(p_j, p_k)``.

    Computed in float64 with the maximum subtracted (tau = 0.001 makes S/tau large). Including
    k = j would add 1 to every S_j and not change alpha. Two prototypes get exactly 1/2 each.
    """
    p = protos.double()
    n = p.shape[0]
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    unit = F.normalize(p, dim=1)
    sim = unit @ unit.T
    score = sim.sum(dim=1) - sim.diagonal()
    return torch.softmax((score - score.max()) / tau, dim=0)


def domain_prototypes(
    uploads: Sequence[Upload], *, fusion: str, tau_agg: float
) -> dict[str, torch.Tensor]:
    """Global prototype per (class, domain) present: ``prototypes``, ``classes``, ``domains``.

    ``fusion: similarity`` is FedDAP Eq. (4-5); ``fusion: mean`` the plain average over the
    clients of that domain that uploaded the class (FedDAP Table 4, "Averaging").
    """
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    dim = 0
    for up in uploads:
        if up.release is None:
            continue
        if up.domain < 0:
            raise ValueError(
                f"feddap: client {up.client} reported no domain; FedDAP needs every client's "
                "domain label with its upload"
            )
        r = up.release
        dim = r.prototypes.shape[1]
        for proto, c in zip(r.prototypes, r.classes.tolist()):
            groups.setdefault((int(c), up.domain), []).append(proto)
    keys = sorted(groups, key=lambda k: (k[1], k[0]))
    if not keys:
        return {}
    protos = []
    for key in keys:
        stack = torch.stack(groups[key])
        if fusion == "mean":
            protos.append(stack.mean(dim=0))
        else:
            w = fusion_weights(stack, tau_agg)
            protos.append((w[:, None] * stack.double()).sum(dim=0).to(stack.dtype))  # Eq. (5)
    return {
        "prototypes": torch.stack(protos).reshape(len(keys), dim),
        "classes": torch.tensor([k[0] for k in keys], dtype=torch.long),
        "domains": torch.tensor([k[1] for k in keys], dtype=torch.long),
    }


def dpa_loss(
    f: torch.Tensor, y: torch.Tensor, domain: int, gs: GlobalState, num_classes: int
) -> torch.Tensor:
    """FedDAP Eq. (6): ``1 - mean_i cos(f_i, G_{y_i, d})`` over samples whose own-domain
    prototype exists (0 when none has one)."""
    own = gs["domains"] == domain
    table = torch.zeros(num_classes, f.shape[1], dtype=f.dtype)
    has = torch.zeros(num_classes, dtype=torch.bool)
    table[gs["classes"][own]] = gs["prototypes"][own].to(f.dtype)
    has[gs["classes"][own]] = True
    mask = has[y]
    if not mask.any():
        return f.sum() * 0.0
    return 1.0 - F.cosine_similarity(f[mask], table[y[mask]], dim=1).mean()


def cpcl_loss(
    f: torch.Tensor, y: torch.Tensor, domain: int, gs: GlobalState, tau: float
) -> torch.Tensor:
    """FedDAP Eq. (7-8): per sample ``-log(sum_{P+} e^{cos/tau} / sum_{P+ u P-} e^{cos/tau})``.

    P+ = same-class prototypes of other domains, P- = other-class prototypes of other domains;
    prototypes of the client's own domain are left out. A sample with no positive or no negative
    contributes 0; the sum is divided by the batch size B (Eq. 8's 1/B).
    """
    other = gs["domains"] != domain
    if not other.any():
        return f.sum() * 0.0
    protos, classes = gs["prototypes"][other].to(f.dtype), gs["classes"][other]
    logits = F.normalize(f, dim=1) @ F.normalize(protos, dim=1).T / tau  # [B, K]
    pos = classes[None, :] == y[:, None]
    valid = pos.any(dim=1) & (~pos).any(dim=1)
    if not valid.any():
        return f.sum() * 0.0
    lg, ps = logits[valid], pos[valid]
    log_all = torch.logsumexp(lg, dim=1)
    log_pos = torch.logsumexp(lg.masked_fill(~ps, float("-inf")), dim=1)
    return (log_all - log_pos).sum() / len(f)


@METHOD_REGISTRY.register("feddap")
class FedDAP(Method):
    """Domain-aware prototypes: similarity-weighted (class, domain) fusion, DPA and CPCL.

    Parameters: ``lambda1`` (DPA weight, 1; 0 disables), ``lambda2`` (CPCL weight, 1; 0
    disables), ``tau_agg`` (0.001), ``tau_cross`` (0.02), ``fusion`` (similarity | mean),
    ``personalized`` (false: FedAvg of weights as in the paper; true: prototypes only),
    ``eval`` (classifier | prototype: nearest (class, domain) prototype by cosine).
    """

    name = "feddap"
    defaults: ClassVar[dict[str, Any]] = {
        "lambda1": 1.0,
        "lambda2": 1.0,
        "tau_agg": 0.001,
        "tau_cross": 0.02,
        "fusion": "similarity",
        "personalized": False,
    }
    eval_modes = ("classifier", "prototype")
    needs_domain = True

    def validate(self) -> None:
        """Check every parameter and set ``shares_weights`` from ``personalized``."""
        p = self.params
        for key in ("lambda1", "lambda2"):
            if not float(p[key]) >= 0:
                raise ValueError(f"feddap.{key}={p[key]!r} must be >= 0")
        for key in ("tau_agg", "tau_cross"):
            if not float(p[key]) > 0:
                raise ValueError(f"feddap.{key}={p[key]!r} must be > 0")
        if p["fusion"] not in ("similarity", "mean"):
            raise ValueError(f"feddap.fusion={p['fusion']!r}; choose similarity or mean")
        if not isinstance(p["personalized"], bool):
            raise ValueError(f"feddap.personalized={p['personalized']!r} must be true or false")
        self.shares_weights = not p["personalized"]

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """One global prototype per (class, domain) present (Eq. 4-5)."""
        return domain_prototypes(
            uploads, fusion=self.params["fusion"], tau_agg=float(self.params["tau_agg"])
        )

    def client_loss(
        self, batch: Batch, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """CE + lambda1 * L_DPA + lambda2 * L_CPCL (Eq. 10)."""
        if batch.domain < 0:
            raise ValueError(f"feddap: client {batch.client} has no domain label")
        loss = F.cross_entropy(batch.logits, batch.y)
        if not global_state or "domains" not in global_state:
            return loss
        lam1, lam2 = float(self.params["lambda1"]), float(self.params["lambda2"])
        if lam1 > 0:
            loss = loss + lam1 * dpa_loss(
                batch.f, batch.y, batch.domain, global_state, self.num_classes
            )
        if lam2 > 0:
            loss = loss + lam2 * cpcl_loss(
                batch.f, batch.y, batch.domain, global_state, float(self.params["tau_cross"])
            )
        return loss

    def predict(
        self, model: ClientModel, z: torch.Tensor, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """Classifier head, or the class of the nearest (class, domain) prototype by cosine."""
        if self.params["eval"] == "classifier" or "domains" not in global_state:
            return super().predict(model, z, global_state, state)
        f = F.normalize(model.features(z), dim=1)
        sim = f @ F.normalize(global_state["prototypes"].to(f.dtype), dim=1).T
        return global_state["classes"][sim.argmax(dim=1)]
