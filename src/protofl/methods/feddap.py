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
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from protofl.methods.base import METHOD_REGISTRY, ClientState, GlobalState, Method, Upload
from protofl.methods.objectives import Group, LocalObjective, Step, Term


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


# ----- the local objective's kernels (leading client dimension k, see methods.objectives) ------
def own_domain_tables(
    gs: GlobalState, domains: Sequence[int], num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per client, the prototype table of its own domain [k, C, d] and which classes have
    one [k, C]."""
    protos, classes = gs["prototypes"], gs["classes"]
    table = torch.zeros(len(domains), num_classes, protos.shape[1], dtype=protos.dtype)
    has = torch.zeros(len(domains), num_classes, dtype=torch.bool)
    for i, domain in enumerate(domains):
        own = gs["domains"] == domain
        table[i, classes[own]] = protos[own]
        has[i, classes[own]] = True
    return table, has


def dpa_kernel(
    f: torch.Tensor, y: torch.Tensor, ok: torch.Tensor, table: torch.Tensor, has: torch.Tensor
) -> torch.Tensor:
    """FedDAP Eq. (6) per client [k]: ``1 - mean_i cos(f_i, G_{y_i, d})`` over the valid
    samples whose own-domain prototype exists (0 for a client with none); ``f`` [k, b, d],
    ``table`` [k, C, d], ``has`` [k, C]."""
    hit = ok & torch.gather(has, 1, y)
    target = torch.gather(table.to(f.dtype), 1, y.unsqueeze(-1).expand(-1, -1, f.shape[-1]))
    cos = F.cosine_similarity(f, target, dim=-1)
    n = hit.sum(dim=1)
    mean = (cos * hit.to(cos.dtype)).sum(dim=1) / n.clamp_min(1).to(cos.dtype)
    return torch.where(n > 0, 1.0 - mean, torch.zeros_like(mean))


def cpcl_kernel(
    f: torch.Tensor,
    y: torch.Tensor,
    ok: torch.Tensor,
    protos: torch.Tensor,
    classes: torch.Tensor,
    other: torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """FedDAP Eq. (7-8) per client [k]: per sample
    ``-log(sum_{P+} e^{cos/tau} / sum_{P+ u P-} e^{cos/tau})`` over the prototypes of the
    *other* domains (``other`` [k, K] marks them per client), positives of the sample's class,
    negatives of the others.  A sample with no positive or no negative contributes 0; the sum
    is divided by the client's batch size B (Eq. 8's 1/B)."""
    logits = F.normalize(f, dim=-1) @ F.normalize(protos.to(f.dtype), dim=-1).T / tau  # [k,b,K]
    same = classes[None, None, :] == y.unsqueeze(-1)
    usable = other.unsqueeze(1)
    pos, neg = same & usable, ~same & usable
    valid = pos.any(dim=-1) & neg.any(dim=-1) & ok
    # a finite floor instead of -inf: rows left out by ``valid`` keep finite gradients (zeroed)
    low = torch.finfo(logits.dtype).min
    log_all = torch.logsumexp(logits.masked_fill(~usable, low), dim=-1)
    log_pos = torch.logsumexp(logits.masked_fill(~pos, low), dim=-1)
    per = torch.where(valid, log_all - log_pos, torch.zeros_like(log_all))
    return per.sum(dim=1) / ok.sum(dim=1).clamp_min(1).to(per.dtype)


def _one(f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return f.unsqueeze(0), y.unsqueeze(0), torch.ones(1, len(y), dtype=torch.bool)


def dpa_loss(
    f: torch.Tensor, y: torch.Tensor, domain: int, gs: GlobalState, num_classes: int
) -> torch.Tensor:
    """FedDAP Eq. (6) for one client's batch (:func:`dpa_kernel` with k = 1)."""
    table, has = own_domain_tables(gs, [domain], num_classes)
    return dpa_kernel(*_one(f, y), table, has)[0]


def cpcl_loss(
    f: torch.Tensor, y: torch.Tensor, domain: int, gs: GlobalState, tau: float
) -> torch.Tensor:
    """FedDAP Eq. (7-8) for one client's batch (:func:`cpcl_kernel` with k = 1)."""
    other = (gs["domains"] != domain).unsqueeze(0)
    return cpcl_kernel(*_one(f, y), gs["prototypes"], gs["classes"], other, tau)[0]


def _domain_state(global_state: GlobalState, group: Group) -> bool:
    if any(d < 0 for d in group.domains):
        raise ValueError("feddap: a client has no domain label; FedDAP needs every client's")
    return bool(global_state) and "domains" in global_state


@dataclass(frozen=True)
class DomainAlignment(Term):
    """``weight * L_DPA`` (FedDAP Eq. 6): features toward their class's prototype of the
    client's own domain."""

    weight: float

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if self.weight == 0 or not _domain_state(global_state, group):
            return None
        return own_domain_tables(global_state, group.domains, group.num_classes)

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        table, has = prepared
        return self.weight * dpa_kernel(step.f, step.y, step.ok, table[rows], has[rows])


@dataclass(frozen=True)
class CrossDomainContrast(Term):
    """``weight * L_CPCL`` (FedDAP Eq. 7-8): InfoNCE over the other domains' prototypes."""

    weight: float
    tau: float

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        if self.weight == 0 or not _domain_state(global_state, group):
            return None
        domains = torch.tensor(list(group.domains), dtype=torch.long)
        other = global_state["domains"][None, :] != domains[:, None]
        return global_state["prototypes"], global_state["classes"], other

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        protos, classes, other = prepared
        return self.weight * cpcl_kernel(
            step.f, step.y, step.ok, protos, classes, other[rows], self.tau
        )


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

    def secure_sum_groups(self) -> str:
        """``domain``: with ``fusion: mean`` a (class, domain) prototype is that domain's class
        sum over its public count (count-weighted, where FedDAP's plain mean weights clients
        equally); similarity fusion weighs each client's prototype, which a sum hides."""
        if self.params["fusion"] != "mean":
            raise ValueError(
                "privacy.mechanism=ddg gives the server only per-domain class sums: feddap's "
                "fusion: similarity weighs each client's prototype; set "
                "method.params.fusion=mean"
            )
        return "domain"

    def objective(self) -> LocalObjective:
        """CE + lambda1 * L_DPA + lambda2 * L_CPCL (Eq. 10)."""
        p = self.params
        return LocalObjective(
            terms=(
                DomainAlignment(float(p["lambda1"])),
                CrossDomainContrast(float(p["lambda2"]), float(p["tau_cross"])),
            )
        )

    def prediction(self) -> str:
        """The classifier head, or :meth:`predict_from`'s cosine (class, domain) rule."""
        return "classifier" if self.params["eval"] == "classifier" else "features"

    def predict_from(
        self, f: torch.Tensor, logits: torch.Tensor, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """The class of the nearest (class, domain) prototype by cosine (the head before any
        arrived)."""
        if "domains" not in global_state:
            return logits.argmax(dim=-1)
        fn = F.normalize(f, dim=-1)
        sim = fn @ F.normalize(global_state["prototypes"].to(f.dtype), dim=-1).T
        return global_state["classes"][sim.argmax(dim=-1)]
