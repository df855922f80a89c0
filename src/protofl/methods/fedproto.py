"""FedProto (Tan et al., AAAI 2022) and the non-federated ``local`` baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from protofl.methods.base import (
    METHOD_REGISTRY,
    GlobalState,
    Method,
    Upload,
    class_robust_mean,
    class_uniform_mean,
    class_weighted_mean,
)
from protofl.methods.objectives import LocalObjective, PrototypePull


@METHOD_REGISTRY.register("local")
class Local(Method):
    """Each client trains alone on its own data: no uploads, no federation."""

    name = "local"
    uses_prototypes = False


@METHOD_REGISTRY.register("fedproto")
class FedProto(Method):
    """Class-mean prototypes; the server averages them; clients add ``lam * MSE(f, G_y)``.

    ``weighting``: ``counts`` (default: per-class counts over the clients that have the class)
    or ``uniform`` (the original FedProto code's unweighted mean over clients).
    ``share_weights``: false (default: prototypes only, the personalised form VPDR uses) or true
    (the engine also FedAvg-averages the trainable weights after each round: FedProto "with
    parameter averaging", as FedDAP Sec. 4.1 compares it; outside the prototype LDP guarantee).
    """

    name = "fedproto"
    defaults: ClassVar[dict[str, Any]] = {
        "lam": 0.1,
        "weighting": "counts",
        "aggregation": "mean",
        "trim_ratio": 0.25,
        "share_weights": False,
    }
    eval_modes = ("classifier", "prototype")

    def validate(self) -> None:
        """``lam`` >= 0; ``weighting`` in counts|uniform; ``share_weights`` a bool."""
        if not float(self.params["lam"]) >= 0:
            raise ValueError(f"fedproto.lam={self.params['lam']!r} must be >= 0")
        if self.params["weighting"] not in ("counts", "uniform"):
            raise ValueError(
                f"fedproto.weighting={self.params['weighting']!r}; choose counts or uniform"
            )
        if self.params["aggregation"] not in ("mean", "median", "trimmed_mean"):
            raise ValueError(
                f"fedproto.aggregation={self.params['aggregation']!r}; "
                "choose mean, median or trimmed_mean"
            )
        if not 0 <= float(self.params["trim_ratio"]) < 0.5:
            raise ValueError(
                f"fedproto.trim_ratio={self.params['trim_ratio']!r} must be in [0, 0.5)"
            )
        if not isinstance(self.params["share_weights"], bool):
            raise ValueError(
                f"fedproto.share_weights={self.params['share_weights']!r} must be a bool"
            )
        self.shares_weights = self.params["share_weights"]

    def aggregate(self, uploads: Sequence[Upload], round_index: int) -> GlobalState:
        """Per-class mean of the uploaded prototypes over the clients that have the class."""
        if self.params["aggregation"] != "mean":
            return class_robust_mean(
                uploads,
                self.num_classes,
                self.proto_dim,
                self.params["aggregation"],
                float(self.params["trim_ratio"]),
            )
        if self.params["weighting"] == "uniform":
            return class_uniform_mean(uploads, self.num_classes, self.proto_dim)
        return class_weighted_mean(uploads, self.num_classes, self.proto_dim)

    def secure_sum_groups(self) -> str:
        """``class``: the count-weighted mean is a class sum over a public count; the median,
        trimmed mean and uniform (per-client) weighting need each client's prototypes."""
        p = self.params
        if p["aggregation"] != "mean" or p["weighting"] != "counts":
            raise ValueError(
                f"privacy.mechanism=ddg gives the server only class sums: fedproto needs "
                f"aggregation: mean and weighting: counts (it has aggregation: "
                f"{p['aggregation']}, weighting: {p['weighting']})"
            )
        return "class"

    def objective(self) -> LocalObjective:
        """CE + lam * MSE(f, G_y) over the samples whose class has a global prototype."""
        return LocalObjective(terms=(PrototypePull(float(self.params["lam"])),))

    def prediction(self) -> str:
        """Classifier head, or nearest global prototype (L2) with ``eval: prototype``."""
        return str(self.params["eval"])
