"""FPL: Federated Prototype Learning (Huang, Ye, Du and Du, "Rethinking Federated Learning with
Domain Shift: A Prototype View", CVPR 2023).

Server (FPL Sec. 3.2, cluster prototypes and unbiased prototypes): for each class c the uploaded
prototypes of all clients are clustered with FINCH (cosine, coarsest partition); the cluster means
are the *cluster prototypes* ``{G^k_c}`` and their plain mean is the *unbiased prototype*
``U_c = (1/K_c) sum_k G^k_c``.

Client (FPL Eq. 5-7):

    L = CE(h(f), y) + w_contrast * L_CPCL + w_mse * L_UPCR

* ``L_CPCL`` (cluster prototypes contrastive learning), per sample, with ``s(a, b) = cos(a, b)``:
  ``-log( sum_{k} exp(s(f, G^k_y)/T) / sum_{c', k} exp(s(f, G^k_{c'})/T) )``, the multi-positive
  InfoNCE whose positives are all cluster prototypes of the sample's class and whose denominator
  runs over the cluster prototypes of every class; ``T = 0.02``.
* ``L_UPCR`` (unbiased prototypes consistent regularisation): ``MSE(f, U_y)``, the mean over batch
  and dimensions.

Both terms use only the samples whose class has a global prototype (a class nobody uploaded is
skipped and reported once). Defaults follow the paper and its released code (weights 1 and 1,
T = 0.02); ``w_contrast = w_mse = 0.5`` gives the VPDR reference code's weighting.

Degenerate clustering: FINCH links two points to each other, so a class with one or two uploaded
prototypes always forms one cluster, whose prototype is their plain mean; then ``U_c`` equals that
mean and ``L_CPCL`` has a single positive per class. (The VPDR code instead falls back to the mean
whenever the total number of uploaded prototypes is small; that global switch is not reproduced.)

FPL's paper also averages the whole model (FedAvg); here that is ``share_weights: true`` and off
by default, because weight averaging is outside the prototype-level LDP guarantee that the
``igpp``/``vpp`` mechanisms give (VPDR's personalised setting shares prototypes only).
"""

from __future__ import annotations

import logging
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
from protofl.methods.finch import cluster_per_class
from protofl.methods.objectives import (
    Group,
    LocalObjective,
    PrototypePull,
    Step,
    Term,
    cosine,
    hit_mean,
    prototype_table,
)

log = logging.getLogger(__name__)


# ----- shared helpers (also used by FedPLVM and FedPCL) -------------------------------------
def cosine_matrix(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``cos(f_i, p_j)`` for every pair ([B, Q]); zero vectors have cosine 0 to everything."""
    return F.normalize(f, dim=-1, eps=1e-8) @ F.normalize(p, dim=-1, eps=1e-8).T


def multi_positive_infonce(logits: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Per-sample ``-log(sum_pos exp(l) / sum_all exp(l))`` ([..., B]), computed with logsumexp.

    ``logits`` [..., B, Q] are similarities already divided by the temperature; ``positive``
    [..., B, Q] is a boolean mask with at least one True per row.
    """
    pos = logits.masked_fill(~positive, float("-inf"))
    return torch.logsumexp(logits, dim=-1) - torch.logsumexp(pos, dim=-1)


def cluster_inputs(global_state: GlobalState, group: Group) -> Any:
    """What the cluster-prototype terms of FPL and FedPLVM read: the cluster prototypes, their
    classes, the class-mean table and which classes have one; None before any arrived."""
    if not has_prototypes(global_state, "cluster_prototypes"):
        return None
    found = prototype_table(global_state, group.num_classes)
    if found is None:
        return None
    table, has = found
    return global_state["cluster_prototypes"], global_state["cluster_classes"], table, has


@dataclass(frozen=True)
class ClusterContrast(Term):
    """``weight * L_CPCL`` (FPL Eq. 5): the multi-positive InfoNCE of ``cos(f, G^k_c) / T`` over
    every cluster prototype, the positives those of the sample's class, averaged over the
    samples whose class has a global prototype; zero for a client with none in the step."""

    weight: float
    temperature: float

    def prepare(self, global_state: GlobalState, group: Group) -> Any:
        return cluster_inputs(global_state, group) if self.weight != 0 else None

    def value(self, step: Step, prepared: Any, rows: slice) -> torch.Tensor:
        if prepared is None:
            return step.zeros()
        centres, owners, _, has = prepared
        hit = has[step.y] & step.ok
        logits = cosine(step.f, centres) / self.temperature
        # rows outside ``hit`` get every prototype as a positive: finite, then masked out
        positive = (owners == step.y.unsqueeze(-1)) | ~hit.unsqueeze(-1)
        per = multi_positive_infonce(logits, positive)
        mean = hit_mean(per, hit)
        return torch.where(hit.any(dim=1), self.weight * mean, torch.zeros_like(mean))


def class_index(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Lookup table class id -> row in ``classes`` (-1 for classes without a row)."""
    table = torch.full((num_classes,), -1, dtype=torch.long)
    table[classes] = torch.arange(len(classes))
    return table


def stacked_release(uploads: Sequence[Upload]) -> tuple[torch.Tensor, torch.Tensor]:
    """All uploaded prototypes and their classes, in upload order."""
    protos = [u.release.prototypes for u in uploads if u.release is not None]
    classes = [u.release.classes for u in uploads if u.release is not None]
    if not protos:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return torch.cat(protos).to(torch.float32), torch.cat(classes)


def report_missing(method: Method, classes: torch.Tensor) -> None:
    """Log, once per distinct set, the classes that no client uploaded this round."""
    missing = sorted(set(range(method.num_classes)) - set(classes.tolist()))
    key = tuple(missing)
    if missing and getattr(method, "_missing_reported", None) != key:
        log.warning(
            "method %s: no client uploaded a prototype for classes %s; their prototype terms are "
            "skipped",
            method.name,
            missing,
        )
        method._missing_reported = key  # type: ignore[attr-defined]


def cluster_aggregate(method: Method, uploads: Sequence[Upload]) -> GlobalState:
    """Per-class FINCH (``method.params["metric"]`` and ``["finch_early_exit"]``) over all
    uploaded prototypes.

    Returns the cluster prototypes and their classes (``cluster_prototypes``,
    ``cluster_classes``) and the per-class mean of the cluster prototypes (``prototypes``,
    ``classes``); ``{}`` when nothing was uploaded. Classes without an upload are reported.
    """
    protos, classes = stacked_release(uploads)
    if protos.numel() == 0:
        report_missing(method, classes)
        return {}
    centres, owners = cluster_per_class(
        protos, classes, method.params["metric"], method.params["finch_early_exit"]
    )
    present = torch.unique(owners)
    means = torch.stack([centres[owners == c].mean(dim=0) for c in present.tolist()])
    report_missing(method, present)
    return {
        "prototypes": means,
        "classes": present,
        "cluster_prototypes": centres,
        "cluster_classes": owners,
    }


def cluster_predict(
    f: torch.Tensor, logits: torch.Tensor, global_state: GlobalState
) -> torch.Tensor:
    """FPL/FedPLVM's ``eval: prototype``: the nearest global cluster prototype by cosine, or
    the head's argmax before any cluster prototype arrived."""
    if not has_prototypes(global_state, "cluster_prototypes"):
        return logits.argmax(dim=-1)
    return nearest_prototype(f, global_state["cluster_prototypes"], global_state["cluster_classes"])


def has_prototypes(global_state: GlobalState, key: str = "prototypes") -> bool:
    """Whether the broadcast holds at least one prototype under ``key``."""
    return key in global_state and global_state[key].shape[0] > 0


def nearest_prototype(
    f: torch.Tensor, prototypes: torch.Tensor, classes: torch.Tensor
) -> torch.Tensor:
    """Class of the most cosine-similar prototype for every row of ``f``."""
    return classes[cosine_matrix(f, prototypes).argmax(dim=1)]


@METHOD_REGISTRY.register("fpl")
class FPL(Method):
    """Cluster prototypes (server FINCH) + unbiased prototypes; CE + CPCL InfoNCE + UPCR MSE.

    Parameters: ``w_contrast`` (1.0), ``w_mse`` (1.0), ``temperature`` (0.02), ``metric``
    (``cosine`` FINCH distance), ``finch_early_exit`` (false: FPL's code calls FINCH with
    ``ensure_early_exit=False``; true: finch-clust's current default), ``share_weights``
    (false), ``eval`` (``classifier`` or ``prototype``: nearest cluster prototype by cosine).
    """

    name = "fpl"
    defaults: ClassVar[dict[str, Any]] = {
        "w_contrast": 1.0,
        "w_mse": 1.0,
        "temperature": 0.02,
        "metric": "cosine",
        "finch_early_exit": False,
        "share_weights": False,
    }
    eval_modes = ("classifier", "prototype")

    def validate(self) -> None:
        """Weights >= 0, temperature > 0, metric cosine|euclidean, the flags bools."""
        for key in ("w_contrast", "w_mse"):
            if not is_number(self.params[key]) or not float(self.params[key]) >= 0:
                raise ValueError(f"fpl.{key}={self.params[key]!r} must be a number >= 0")
        t = self.params["temperature"]
        if not is_number(t) or not float(t) > 0:
            raise ValueError(f"fpl.temperature={t!r} must be a number > 0")
        if self.params["metric"] not in ("cosine", "euclidean"):
            raise ValueError(f"fpl.metric={self.params['metric']!r}; choose cosine or euclidean")
        for key in ("finch_early_exit", "share_weights"):
            if not isinstance(self.params[key], bool):
                raise ValueError(f"fpl.{key}={self.params[key]!r} must be a bool")
        self.shares_weights = self.params["share_weights"]

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Per-class FINCH over all uploaded prototypes -> cluster prototypes and their mean."""
        return cluster_aggregate(self, uploads)

    def objective(self) -> LocalObjective:
        """``CE + w_contrast * L_CPCL + w_mse * L_UPCR`` (FPL Eq. 7); L_UPCR is the MSE to the
        unbiased prototype ``U_y`` (the broadcast ``prototypes``)."""
        p = self.params
        return LocalObjective(
            terms=(
                ClusterContrast(float(p["w_contrast"]), float(p["temperature"])),
                PrototypePull(float(p["w_mse"])),
            )
        )

    def prediction(self) -> str:
        """The head (``eval: classifier``), or :meth:`predict_from`'s cosine rule."""
        return "classifier" if self.params["eval"] == "classifier" else "features"

    def predict_from(
        self, f: torch.Tensor, logits: torch.Tensor, global_state: GlobalState, state: ClientState
    ) -> torch.Tensor:
        """The nearest cluster prototype by cosine (``eval: prototype``)."""
        return cluster_predict(f, logits, global_state)


def is_number(v: Any) -> bool:
    """A real number (not a bool)."""
    return isinstance(v, int | float) and not isinstance(v, bool)
