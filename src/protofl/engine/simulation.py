"""The in-process simulator: deterministic rounds of release -> aggregate -> train -> evaluate."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from protofl.config import ExperimentConfig
from protofl.engine.federated_data import ClientData, FederatedData
from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, GlobalState, Method, Upload
from protofl.models.client import ClientModel, build_client_model
from protofl.privacy import create_mechanism
from protofl.privacy.base import Mechanism, Release
from protofl.privacy.ledger import PrivacyLedger

log = logging.getLogger(__name__)

EVAL_BATCH = 2048


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed derived from the experiment seed and a path of integer keys."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


@dataclass
class Client:
    """Everything one simulated client owns."""

    data: ClientData
    model: ClientModel
    optimizer: torch.optim.Optimizer
    state: ClientState
    ledger: PrivacyLedger
    train_gen: torch.Generator
    noise_gen: torch.Generator
    dcr: Any = None


@dataclass
class RoundMetrics:
    """One round's results (accuracies are fractions in [0, 1])."""

    round: int
    acc: dict[str, float]
    client_acc: dict[str, float]
    avg_acc: float
    std_acc: float
    train_loss: float
    wall_s: float
    privacy: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict for metrics.jsonl."""
        return {
            "round": self.round,
            "acc": self.acc,
            "client_acc": self.client_acc,
            "avg_acc": self.avg_acc,
            "std_acc": self.std_acc,
            "train_loss": self.train_loss,
            "wall_s": self.wall_s,
            "privacy": self.privacy,
        }


class Simulation:
    """Holds clients, server method state and the mechanism; ``run_round`` advances one round."""

    def __init__(self, config: ExperimentConfig, data: FederatedData) -> None:
        self.config = config
        self.data = data
        fed = config.federation
        self.method: Method = create_method(
            config.method.name,
            config.method.params,
            num_classes=data.num_classes,
            num_domains=len(data.domains),
            proto_dim=config.backbone.proto_dim,
        )
        if self.method.needs_domain and any(c.domain < 0 for c in data.clients):
            raise ValueError(f"method {self.method.name!r} needs every client to report a domain")
        self.mechanism: Mechanism = create_mechanism(
            config.privacy, rounds=fed.rounds, dim=config.backbone.proto_dim
        )
        self.global_state: GlobalState = {}
        self.round = 0
        init_gen = torch.Generator().manual_seed(derive_seed(config.seed, 1))
        template = build_client_model(
            data.feature_dim, data.num_classes, config.backbone, init_gen
        )
        self.clients: list[Client] = []
        for cd in data.clients:
            model = build_client_model(data.feature_dim, data.num_classes, config.backbone, init_gen)
            model.load_state_dict(template.state_dict())
            opt = torch.optim.AdamW(
                model.trainable_parameters(), lr=fed.lr, weight_decay=fed.weight_decay
            )
            dcr = None
            if config.privacy.use_dcr:
                from protofl.privacy.dcr import DCR

                dcr = DCR(config.privacy, model.head)
            self.clients.append(
                Client(
                    data=cd,
                    model=model,
                    optimizer=opt,
                    state=ClientState(),
                    ledger=PrivacyLedger(
                        delta=config.privacy.delta, accountant=config.privacy.accountant
                    ),
                    train_gen=torch.Generator().manual_seed(derive_seed(config.seed, 2, cd.client)),
                    noise_gen=torch.Generator().manual_seed(derive_seed(config.seed, 3, cd.client)),
                    dcr=dcr,
                )
            )
        self.releases: list[list[Release | None]] = []

    # ----- one round --------------------------------------------------------------------------
    def collect_uploads(self) -> list[Upload]:
        """Every client computes features with its current model and releases prototypes."""
        uploads: list[Upload] = []
        cluster_fn = self.method.cluster_fn()
        round_releases: list[Release | None] = []
        for c in self.clients:
            release = None
            if self.method.uses_prototypes:
                c.model.eval()
                with torch.no_grad():
                    feats = self.method.upload_features(c.model, c.data.train_z)
                release = self.mechanism.release(
                    feats,
                    c.data.train_y,
                    num_classes=self.data.num_classes,
                    generator=c.noise_gen,
                    client=c.data.name,
                    cluster_fn=cluster_fn,
                )
                c.ledger.record(self.round, release)
            round_releases.append(release)
            uploads.append(
                Upload(
                    client=c.data.client,
                    domain=c.data.domain,
                    release=release,
                    num_samples=c.data.num_train,
                )
            )
        self.releases.append(round_releases)
        return uploads

    def train_client(self, c: Client) -> float:
        """E local epochs of the method's objective (plus DCR); returns the mean batch loss."""
        fed = self.config.federation
        self.method.begin_local(c.model, c.state, self.global_state, c.data.client)
        c.model.train()
        n = c.data.num_train
        total, steps = 0.0, 0
        for _ in range(fed.local_epochs):
            perm = torch.randperm(n, generator=c.train_gen)
            for start in range(0, n, fed.batch_size):
                idx = perm[start : start + fed.batch_size]
                z, y = c.data.train_z[idx], c.data.train_y[idx]
                f_raw = c.model.features(z)
                f = c.dcr.soft_clip(f_raw) if c.dcr is not None else f_raw
                logits = c.model.head(f)
                batch = Batch(z=z, y=y, f=f, f_raw=f_raw, logits=logits, model=c.model,
                              client=c.data.client, domain=c.data.domain)
                loss = self.method.client_loss(batch, self.global_state, c.state)
                if c.dcr is not None:
                    loss = loss + c.dcr.kd_loss(f_raw, logits)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"client {c.data.name!r}, round {self.round}: local loss is {loss.item()}"
                    )
                c.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                c.optimizer.step()
                if c.dcr is not None:
                    c.dcr.after_step(c.model.head)
                total += float(loss.detach())
                steps += 1
        self.method.end_local(c.model, c.state, self.global_state, c.data.client)
        return total / max(steps, 1)

    def average_weights(self) -> None:
        """FedAvg of the trainable weights (sample-weighted) for methods that share weights."""
        weights = torch.tensor([c.data.num_train for c in self.clients], dtype=torch.float64)
        weights = weights / weights.sum()
        states = [c.model.state_dict() for c in self.clients]
        avg = {
            k: sum(float(w) * s[k].double() for w, s in zip(weights, states)).to(states[0][k].dtype)
            for k in states[0]
        }
        for c in self.clients:
            c.model.load_state_dict(avg)
        self.global_state["__weights_round"] = torch.tensor(self.round)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy of every client on its own domain's test set (fractions)."""
        out: dict[str, float] = {}
        for c in self.clients:
            c.model.eval()
            correct = 0
            for start in range(0, len(c.data.test_y), EVAL_BATCH):
                z = c.data.test_z[start : start + EVAL_BATCH]
                y = c.data.test_y[start : start + EVAL_BATCH]
                pred = self.method.predict(c.model, z, self.global_state, c.state)
                correct += int((pred == y).sum())
            out[c.data.name] = correct / max(len(c.data.test_y), 1)
        return out

    def run_round(self) -> RoundMetrics:
        """One full round; returns its metrics."""
        t0 = time.perf_counter()
        uploads = self.collect_uploads()
        self.global_state = self.method.aggregate(uploads, self.round)
        losses = [self.train_client(c) for c in self.clients]
        if self.method.shares_weights:
            self.average_weights()
        client_acc = self.evaluate()
        per_domain: dict[str, list[float]] = {}
        for c in self.clients:
            per_domain.setdefault(c.data.domain_name, []).append(client_acc[c.data.name])
        acc = {d: float(np.mean(v)) for d, v in per_domain.items()}
        values = list(acc.values())
        metrics = RoundMetrics(
            round=self.round + 1,
            acc=acc,
            client_acc=client_acc,
            avg_acc=float(np.mean(values)),
            std_acc=float(np.std(values)),
            train_loss=float(np.mean(losses)),
            wall_s=time.perf_counter() - t0,
            privacy=self.privacy_status(),
        )
        self.round += 1
        return metrics

    def privacy_status(self) -> dict[str, Any]:
        """Epsilon spent per client (None without a guarantee) and the release facts."""
        if not self.method.uses_prototypes:
            return {"mechanism": "n/a (no prototype release)"}
        eps = {c.data.name: c.ledger.epsilon_spent() for c in self.clients}
        status: dict[str, Any] = {"epsilon_spent": eps}
        last = [r for r in self.releases[-1] if r is not None] if self.releases else []
        overlaps = [r.info["partition_overlap"] for r in last if "partition_overlap" in r.info]
        if overlaps:
            status["partition_overlap"] = float(np.mean(overlaps))
        return status

    def run(
        self, rounds: int | None = None, on_round: Callable[[RoundMetrics], None] | None = None
    ) -> list[RoundMetrics]:
        """Run the remaining rounds (or ``rounds`` of them)."""
        todo = self.config.federation.rounds - self.round if rounds is None else rounds
        history = []
        for _ in range(todo):
            m = self.run_round()
            history.append(m)
            if on_round is not None:
                on_round(m)
        return history


def summarise(history: Sequence[RoundMetrics]) -> dict[str, Any]:
    """Final-round per-domain accuracy, AVG, STD (fractions) and totals."""
    last = history[-1]
    return {
        "acc": last.acc,
        "client_acc": last.client_acc,
        "avg_acc": last.avg_acc,
        "std_acc": last.std_acc,
        "avg_acc_last5": float(np.mean([h.avg_acc for h in history[-5:]])),
        "rounds": last.round,
        "wall_s": float(sum(h.wall_s for h in history)),
        "final_train_loss": last.train_loss,
    }


def initial_loss(sim: Simulation) -> float:
    """Mean cross-entropy of the untrained clients on their training data (a baseline)."""
    vals = []
    with torch.no_grad():
        for c in sim.clients:
            _, logits = c.model(c.data.train_z)
            vals.append(float(F.cross_entropy(logits, c.data.train_y)))
    return float(np.mean(vals)) if vals else math.nan
