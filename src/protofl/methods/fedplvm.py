"""FedPLVM: Federated Prototype Learning across Varied domains (Wang, Luo, Zhao et al., "Taming
Cross-Domain Representation Variance in Federated Prototype Learning with Heterogeneity
Disparity", NeurIPS 2024).

Dual-level prototype clustering (FedPLVM Sec. 4.1):

* client: for each class, FINCH (cosine, coarsest partition) over the class's features gives
  several local cluster centres. Here the clustering runs inside the privacy mechanism on the
  *clipped* features (:meth:`FedPLVM.cluster_fn`), so every centre is released with the
  sensitivity of its own cluster size (``2R / n_k`` under replace-one).
* server: for each class, FINCH over all clients' uploaded centres gives the global cluster
  prototypes ``P_c``; ``pbar_c`` is their plain mean.

Client objective (FedPLVM Sec. 4.2, Eq. 6-9):

    L = CE(h(f), y) + lam * (L_alpha + L_corr)

* alpha-sparsity similarity: ``s = cos(f, p)``, ``s_alpha = sign(s) |s|^alpha`` (alpha = 0.25).
  The original code writes ``s.pow(alpha)``, NaN for negative cosines; the sign-preserving form is
  the paper's intent and stays finite (``|s|`` is clamped at 1e-6 before the power, so the
  gradient is finite at 0).
* ``L_alpha`` (``contrast: multi_positive``, default, the original):
  ``-log( sum_{p in P_y} exp(s_alpha(f,p)/tau) / sum_{p in P} exp(s_alpha(f,p)/tau) )``, tau = 0.07;
  ``contrast: supcon`` is the VPDR code's form ``-(1/|P_y|) sum_{p in P_y} log softmax_p``.
* ``L_corr`` (``correction: mse``, default, the original): ``2 * MSE(cos(f, pbar_y), 1)``;
  ``correction: abs_sum`` is the VPDR code's ``| sum_{p in P_y} s_alpha(f,p) - |P_y| |``.

``lam`` default 0.5 (VPDR code), not the original's 100: the original pairs 100 with plain SGD on
a ResNet trained from scratch, where the prototype terms shape the representation; here the local
optimiser is AdamW on an adapter over a frozen backbone and, under LDP, the prototypes are mostly
noise, so a weight of 100 lets noisy targets swamp the classification loss (see
docs/methods_contrastive.md for the measurement). ``lam: 100`` reproduces the original.

FedPLVM also averages the whole model (FedAvg); that is ``share_weights: true``, off by default
because weight averaging is outside the prototype LDP guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from protofl.methods.base import (
    METHOD_REGISTRY,
    ClientState,
    GlobalState,
    Method,
    Upload,
)
from protofl.methods.finch import finch_cluster_fn
from protofl.methods.fpl import (
    cluster_aggregate,
    cluster_inputs,
    cluster_predict,
    is_number,
    multi_positive_infonce,
)
from protofl.methods.objectives import Group, LocalObjective, Step, Term, cosine, hit_mean
from protofl.privacy.base import ClusterFn


def alpha_sparsity(s: torch.Tensor, alpha: float, eps: float = 1e-6) -> torch.Tensor:
    """``sign(s) * |s|^alpha`` (FedPLVM Eq. 7), finite with finite gradients everywhere."""
    return torch.sign(s) * s.abs().clamp_min(eps).pow(alpha)


@dataclass(frozen=True)
class AlphaSparsityContrast(Term):
    """``lam * (L_alpha + L_corr)`` (FedPLVM Eq. 6-9), averaged over the samples whose class has
    global prototypes; zero for a client with none in the step (module docstring)."""

    lam: float
    alpha: float
    tau: float
    contrast: str = "multi_positive"
    correction: str = "mse"

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        return cluster_inputs(global_state, group) if self.lam != 0 else None

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        centres, owners, table, has = prepared
        f, y = step.f, step.y
        hit = has[y] & step.ok
        s_alpha = alpha_sparsity(cosine(f, centres), self.alpha)  # [k, b, Q]
        positive = owners == y.unsqueeze(-1)
        safe = positive | ~hit.unsqueeze(-1)  # finite rows outside ``hit``, masked out below
        logits = s_alpha / self.tau
        if self.contrast == "multi_positive":
            l_alpha = multi_positive_infonce(logits, safe)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            l_alpha = -(logp * safe).sum(dim=-1) / safe.sum(dim=-1)
        if self.correction == "mse":
            cos = F.cosine_similarity(f, table[y].to(f.dtype), dim=-1, eps=1e-8)
            l_corr = 2.0 * (cos - 1.0) ** 2
        else:
            l_corr = ((s_alpha * positive).sum(dim=-1) - positive.sum(dim=-1)).abs()
        mean = hit_mean(l_alpha + l_corr, hit)
        return torch.where(hit.any(dim=1), self.lam * mean, torch.zeros_like(mean))


@METHOD_REGISTRY.register("fedplvm")
class FedPLVM(Method):
    """Local + global FINCH prototypes; CE + lam * (alpha-sparsity contrast + correction).

    Parameters: ``lam`` (0.5), ``alpha`` (0.25), ``tau`` (0.07), ``contrast``
    (``multi_positive`` | ``supcon``), ``correction`` (``mse`` | ``abs_sum``), ``local_clustering``
    (true: FINCH per class on the client; false: one class mean), ``metric`` (``cosine``),
    ``finch_early_exit`` (false; true: finch-clust's current ``ensure_early_exit`` default, on
    the client and on the server), ``share_weights`` (false), ``eval`` (``classifier`` |
    ``prototype``).
    """

    name = "fedplvm"
    defaults: ClassVar[dict[str, Any]] = {
        "lam": 0.5,
        "alpha": 0.25,
        "tau": 0.07,
        "contrast": "multi_positive",
        "correction": "mse",
        "local_clustering": True,
        "metric": "cosine",
        "finch_early_exit": False,
        "share_weights": False,
    }
    eval_modes = ("classifier", "prototype")

    def validate(self) -> None:
        """lam >= 0, 0 < alpha <= 1, tau > 0, the choices known, the flags bools."""
        p = self.params
        if not is_number(p["lam"]) or not float(p["lam"]) >= 0:
            raise ValueError(f"fedplvm.lam={p['lam']!r} must be a number >= 0")
        if not is_number(p["alpha"]) or not 0 < float(p["alpha"]) <= 1:
            raise ValueError(f"fedplvm.alpha={p['alpha']!r} must be in (0, 1]")
        if not is_number(p["tau"]) or not float(p["tau"]) > 0:
            raise ValueError(f"fedplvm.tau={p['tau']!r} must be a number > 0")
        if p["contrast"] not in ("multi_positive", "supcon"):
            raise ValueError(f"fedplvm.contrast={p['contrast']!r}; choose multi_positive or supcon")
        if p["correction"] not in ("mse", "abs_sum"):
            raise ValueError(f"fedplvm.correction={p['correction']!r}; choose mse or abs_sum")
        if p["metric"] not in ("cosine", "euclidean"):
            raise ValueError(f"fedplvm.metric={p['metric']!r}; choose cosine or euclidean")
        for key in ("local_clustering", "finch_early_exit", "share_weights"):
            if not isinstance(p[key], bool):
                raise ValueError(f"fedplvm.{key}={p[key]!r} must be a bool")
        self.shares_weights = p["share_weights"]

    def cluster_fn(self) -> ClusterFn | None:
        """Local FINCH (coarsest partition) on one class's clipped features."""
        if not self.params["local_clustering"]:
            return None
        return finch_cluster_fn(self.params["metric"], self.params["finch_early_exit"])

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Per-class FINCH over all uploaded centres -> global cluster prototypes, class means."""
        return cluster_aggregate(self, uploads)

    def objective(self) -> LocalObjective:
        """``CE + lam * (L_alpha + L_corr)`` over the samples whose class has prototypes."""
        p = self.params
        return LocalObjective(
            terms=(
                AlphaSparsityContrast(
                    float(p["lam"]),
                    float(p["alpha"]),
                    float(p["tau"]),
                    str(p["contrast"]),
                    str(p["correction"]),
                ),
            )
        )

    def prediction(self) -> str:
        """The head (``eval: classifier``), or :meth:`predict_from`'s cosine rule."""
        return "classifier" if self.params["eval"] == "classifier" else "features"

    def predict_from(
        self, f: torch.Tensor, logits: torch.Tensor, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """The nearest global cluster prototype by cosine (``eval: prototype``)."""
        return cluster_predict(f, logits, global_state)
