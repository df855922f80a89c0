"""The in-process simulator: deterministic rounds of release -> aggregate -> train -> evaluate."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from protofl.config import ExperimentConfig
from protofl.engine.federated_data import ClientData, FederatedData
from protofl.engine.optimizers import make_optimizer
from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, GlobalState, Method, Upload
from protofl.models.backbones import backbone_class
from protofl.models.client import ClientModel
from protofl.privacy import create_mechanism
from protofl.privacy.base import Mechanism, Release
from protofl.privacy.guarantee import describe_guarantee
from protofl.privacy.ledger import PrivacyLedger
from protofl.privacy.noise import derive_seed, noise_generator, resolve_noise_mode
from protofl.report.norms import feature_norm_stats

log = logging.getLogger(__name__)

EVAL_BATCH = 2048

LOCAL_ONLY_FIELDS = ("feature_norms", "mia", "privacy.partition_overlap", "train_loss")
"""Fields of a metrics row computed on clients' private data outside the privacy mechanism:
diagnostics for the experimenter's own run files, never sent by a deployed client."""


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
    holdout_acc: float | None = None
    participants: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    feature_norms: dict[str, dict[str, float]] = field(default_factory=dict)
    mia: dict[str, dict[str, float]] = field(default_factory=dict)
    missing_classes: list[int] = field(default_factory=list)

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
            "holdout_acc": self.holdout_acc,
            "participants": self.participants,
            "rejected": self.rejected,
            "feature_norms": self.feature_norms,
            "mia": self.mia,
            "missing_classes": self.missing_classes,
            "local_only": list(LOCAL_ONLY_FIELDS),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundMetrics:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: v for k, v in data.items() if k != "local_only"})


class Simulation:
    """Holds clients, server method state and the mechanism; ``run_round`` advances one round."""

    def __init__(
        self, config: ExperimentConfig, data: FederatedData, *, deployment: bool = False
    ) -> None:
        self.config = config
        # derived (reproducible; whoever holds the config can remove the noise) or secret
        self.noise_mode = resolve_noise_mode(config.privacy.noise_seed, deployment=deployment)
        self.data = data
        fed = config.federation
        self.method: Method = create_method(
            config.method.name,
            config.method.params,
            num_classes=data.num_classes,
            num_domains=len(data.domains),
            proto_dim=config.backbone.proto_dim,
            seed=config.seed,
        )
        if self.method.needs_domain and any(c.domain < 0 for c in data.clients):
            raise ValueError(f"method {self.method.name!r} needs every client to report a domain")
        self.mechanism: Mechanism = create_mechanism(
            config.privacy, rounds=fed.rounds, dim=config.backbone.proto_dim
        )
        self.global_state: GlobalState = {}
        self.round = 0
        backbone_cls = backbone_class(config.backbone)
        init_seed = derive_seed(config.seed, 1)
        self.clients: list[Client] = []
        # identical frozen parameters (a frozen projection, frozen transformer blocks) are held
        # once for all clients instead of once per client; trainable ones stay per client
        from protofl.engine.batched import FrozenParameterPool

        self.frozen_pool = FrozenParameterPool()
        for cd in data.clients:
            model: ClientModel = backbone_cls.client_model(  # type: ignore[assignment]
                data.feature_dim,
                data.num_classes,
                config.backbone,
                torch.Generator().manual_seed(init_seed),
                client=cd.client,
            )
            self.frozen_pool.share(model)
            opt = make_optimizer(model.trainable_parameters(), fed)
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
                    noise_gen=noise_generator(self.noise_mode, config.seed, cd.client),
                    dcr=dcr,
                )
            )
        unknown = set(config.federation.poison) - {c.data.name for c in self.clients}
        if unknown:
            raise ValueError(
                f"federation.poison names unknown client(s) {sorted(unknown)}; clients: "
                + ", ".join(c.data.name for c in self.clients)
            )
        if self.method.shares_weights and len(self.clients) > 1:
            shapes = {
                tuple((k, tuple(v.shape)) for k, v in c.model.state_dict().items())
                for c in self.clients
            }
            if len(shapes) > 1:
                raise ValueError(
                    f"method {self.method.name!r} averages model weights, but backbone "
                    f"{config.backbone.name!r} gives clients models of different shapes; use a "
                    "prototype-only method (or a homogeneous backbone)"
                )
        self.releases: list[list[Release | None]] = []
        self.last_feature_norms: dict[str, dict[str, float]] = {}
        self.last_mia: dict[str, dict[str, float]] = {}
        self.history: list[RoundMetrics] = []
        self.batched: Any = None
        self.server_gen = torch.Generator().manual_seed(derive_seed(config.seed, 4))
        # local-only diagnostics (computed on private data) are kept; a deployed client sends none
        self.diagnostics = True
        # with noisy add/remove counts, the server weights a client by the sum of its last noisy
        # counts (post-processing), never by the exact count
        self.public_counts: dict[int, int] = {}

    # ----- what the server may know about a client's size --------------------------------------
    @property
    def counts_public(self) -> bool:
        """Whether exact sample counts are public under the neighbouring relation."""
        return self.config.privacy.counts_public

    def public_count(self, c: Client) -> int:
        """The sample count the server may use for ``c``: exact when counts are public, else the
        sum of the client's last released noisy counts (0 before its first release)."""
        if self.counts_public:
            return c.data.num_train
        return self.public_counts.get(c.data.client, 0)

    # ----- one round --------------------------------------------------------------------------
    def select_participants(self) -> list[bool]:
        """Which clients take part this round (seeded sampling, then independent dropout)."""
        fed = self.config.federation
        m = len(self.clients)
        chosen = [True] * m
        if fed.participation < 1.0:
            k = max(1, math.ceil(fed.participation * m))
            picked = torch.randperm(m, generator=self.server_gen)[:k].tolist()
            chosen = [i in picked for i in range(m)]
        if fed.dropout > 0:
            drops = torch.rand(m, generator=self.server_gen) < fed.dropout
            chosen = [ch and not bool(d) for ch, d in zip(chosen, drops)]
        return chosen

    def batched_trainer(self) -> Any:
        """The :class:`~protofl.engine.batched.BatchedTrainer` when ``federation.execution`` is
        ``batched`` and this run can batch (else None: the sequential paths run; the trainer
        logs why once)."""
        if self.config.federation.execution != "batched":
            return None
        if self.batched is None:
            from protofl.engine.batched import BatchedTrainer

            self.batched = BatchedTrainer(self)
        return self.batched if self.batched.supported else None

    def collect_uploads(self, active: Sequence[bool] | None = None) -> list[Upload]:
        """Every active client computes features with its current model and releases prototypes.

        A client that does not take part releases nothing and is charged nothing.  In batched
        execution the features and releases of all clients are computed together (the same
        releases, ledger entries and diagnostics; see ``BatchedTrainer.collect_uploads``).
        """
        trainer = self.batched_trainer()
        if trainer is not None:
            return trainer.collect_uploads(active)  # type: ignore[no-any-return]
        norms: dict[str, dict[str, float]] = {}
        mia: dict[str, dict[str, float]] = {}
        self.last_feature_norms = norms
        self.last_mia = mia
        cluster_fn = self.method.cluster_fn()
        sent: dict[int, Release | None] = {}
        for i, c in enumerate(self.clients):
            release = None
            if active is not None and not active[i]:
                continue
            if self.method.uses_prototypes:
                c.model.eval()
                with torch.no_grad():
                    feats = self.method.upload_features(c.model, c.data.train_z.float())
                # a local diagnostic (VPDR Fig. 4a): never uploaded, not covered by the DP claim
                norms[c.data.name] = feature_norm_stats(feats, clip=self.config.privacy.clip)
                release = self.mechanism.release(
                    feats,
                    c.data.train_y,
                    num_classes=self.data.num_classes,
                    generator=c.noise_gen,
                    client=c.data.name,
                    cluster_fn=cluster_fn,
                )
                c.ledger.record(self.round, release)
                scale = self.config.federation.poison.get(c.data.name)
                if scale is not None:
                    # attack simulation (robust-aggregation experiments): after its honest
                    # release, this client sends its prototypes flipped and scaled
                    release = replace(release, prototypes=-float(scale) * release.prototypes)
                k = self.config.run.mia_every
                if k and (self.round + 1) % k == 0:
                    # the paper's audit (VPDR App. E.6.2) on this very release
                    from protofl.attacks.mia import mia_on_release

                    with torch.no_grad():
                        test_f = self.method.upload_features(c.model, c.data.test_z.float())
                    mia[c.data.name] = mia_on_release(
                        feats,
                        c.data.train_y,
                        test_f,
                        c.data.test_y,
                        release,
                        seed=derive_seed(self.config.seed, 5, c.data.client, self.round),
                    )
            sent[c.data.client] = release
        return self.record_uploads(sent, active)

    def record_uploads(
        self, sent: dict[int, Release | None], active: Sequence[bool] | None
    ) -> list[Upload]:
        """The round's uploads from what each active client sent (keyed by client id), in
        client order; the round's row of ``self.releases`` (None for a client that sat out)."""
        round_releases: list[Release | None] = []
        uploads: list[Upload] = []
        for i, c in enumerate(self.clients):
            if active is not None and not active[i]:
                round_releases.append(None)
                continue
            release = sent.get(c.data.client)
            round_releases.append(release)
            if release is not None and not self.counts_public:
                self.public_counts[c.data.client] = int(release.counts.sum())
            uploads.append(
                Upload(
                    client=c.data.client,
                    domain=c.data.domain,
                    release=release,
                    num_samples=self.public_count(c),
                )
            )
        self.releases.append(round_releases)
        return uploads

    def train_client(self, c: Client) -> float:
        """E local epochs of the method's objective (plus DCR); returns the mean batch loss.

        Anything in the client model that draws from torch's global generator (the ViT
        adapters' dropout) draws from a fork of it seeded by (seed, client, round), so runs and
        resumed runs repeat exactly; the global generator is left as it was.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.config.seed, 6, c.data.client, self.round))
            return self._train_client(c)

    def _train_client(self, c: Client) -> float:
        fed = self.config.federation
        self.method.begin_local(c.model, c.state, self.global_state, c.data.client)
        c.model.train()
        n = c.data.num_train
        total, steps = 0.0, 0
        for _ in range(fed.local_epochs):
            perm = torch.randperm(n, generator=c.train_gen)
            for start in range(0, n, fed.batch_size):
                idx = perm[start : start + fed.batch_size]
                z, y = c.data.train_z[idx].float(), c.data.train_y[idx]
                f_raw = c.model.features(z)
                f = c.dcr.soft_clip(f_raw) if c.dcr is not None else f_raw
                logits = c.model.head(f)
                batch = Batch(
                    z=z,
                    y=y,
                    f=f,
                    f_raw=f_raw,
                    logits=logits,
                    model=c.model,
                    client=c.data.client,
                    domain=c.data.domain,
                )
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

    def train_active(self, clients: list[Client]) -> list[float]:
        """Local training of the round's participants: batched when configured and supported
        by the method (``federation.execution: batched``), else one client after another."""
        trainer = self.batched_trainer()
        if trainer is not None:
            return trainer.train(clients)  # type: ignore[no-any-return]
        return [self.train_client(c) for c in clients]

    def average_weights(self, active: Sequence[bool] | None = None) -> None:
        """FedAvg (sample-weighted) of the weights of the clients that trained; sent to all."""
        members = [c for i, c in enumerate(self.clients) if active is None or active[i]]
        weights = torch.tensor([self.public_count(c) for c in members], dtype=torch.float64)
        weights = (
            weights / weights.sum() if float(weights.sum()) > 0 else weights.fill_(1 / len(members))
        )
        states = [c.model.state_dict() for c in members]
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
        trainer = self.batched_trainer()
        if trainer is not None:
            return trainer.evaluate()  # type: ignore[no-any-return]
        out: dict[str, float] = {}
        for c in self.clients:
            c.model.eval()
            correct = 0
            for start in range(0, len(c.data.test_y), EVAL_BATCH):
                z = c.data.test_z[start : start + EVAL_BATCH].float()
                y = c.data.test_y[start : start + EVAL_BATCH]
                pred = self.method.predict(c.model, z, self.global_state, c.state)
                correct += int((pred == y).sum())
            out[c.data.name] = correct / max(len(c.data.test_y), 1)
        return out

    @torch.no_grad()
    def evaluate_holdout(self) -> float | None:
        """Mean accuracy of all clients on the held-out domain (leave-one-domain-out)."""
        if self.data.holdout is None:
            return None
        trainer = self.batched_trainer()
        if trainer is not None:
            return trainer.evaluate_holdout()  # type: ignore[no-any-return]
        _, z, y = self.data.holdout
        accs = []
        for c in self.clients:
            c.model.eval()
            correct = 0
            for start in range(0, len(y), EVAL_BATCH):
                pred = self.method.predict(
                    c.model, z[start : start + EVAL_BATCH].float(), self.global_state, c.state
                )
                correct += int((pred == y[start : start + EVAL_BATCH]).sum())
            accs.append(correct / max(len(y), 1))
        return float(np.mean(accs))

    def run_round(self) -> RoundMetrics:
        """One full round; returns its metrics."""
        t0 = time.perf_counter()
        active = self.select_participants()
        uploads = self.collect_uploads(active)
        accepted, rejected = self.validate(uploads)
        self.global_state = self.method.aggregate(accepted, self.round)
        missing = self.missing_classes(accepted)
        losses = self.train_active([c for c, a in zip(self.clients, active) if a])
        if self.method.shares_weights and any(active):
            self.average_weights(active)
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
            train_loss=float(np.mean(losses)) if losses else math.nan,
            wall_s=time.perf_counter() - t0,
            privacy=self.privacy_status(),
            holdout_acc=self.evaluate_holdout(),
            participants=[c.data.name for c, a in zip(self.clients, active) if a],
            feature_norms=self.last_feature_norms,
            mia=self.last_mia,
            missing_classes=missing,
            rejected=rejected,
        )
        self.round += 1
        self.history.append(metrics)
        return metrics

    def missing_classes(self, accepted: list[Upload]) -> list[int]:
        """Classes no accepted upload carries this round (reported, never invented)."""
        if not self.method.uses_prototypes or not accepted:
            return []
        present: set[int] = set()
        for up in accepted:
            if up.release is not None:
                present.update(int(c) for c in up.release.classes.tolist())
        missing = [c for c in range(self.data.num_classes) if c not in present]
        if missing:
            log.warning(
                "round %d: no client uploaded a prototype of class(es) %s", self.round + 1, missing
            )
        return missing

    def validate(self, uploads: list[Upload]) -> tuple[list[Upload], list[dict[str, str]]]:
        """Server-side upload validation; rejected uploads are logged and left out."""
        from protofl.methods.validation import validate_upload

        accepted, rejected = [], []
        for up in uploads:
            client = self.clients[up.client]
            reason = validate_upload(
                up,
                declared_domain=client.data.domain,
                num_classes=self.data.num_classes,
                dim=self.config.backbone.proto_dim,
                norm_bound=self.mechanism.norm_bound,
                one_per_class=self.method.cluster_fn() is None,
            )
            if reason is None:
                accepted.append(up)
            else:
                log.warning(
                    "round %d: rejected upload of client %r: %s",
                    self.round + 1,
                    client.data.name,
                    reason,
                )
                rejected.append({"client": client.data.name, "reason": reason})
        return accepted, rejected

    def privacy_status(self) -> dict[str, Any]:
        """Epsilon spent per client (None without a guarantee) and the release facts."""
        if not self.method.uses_prototypes:
            return {"mechanism": "n/a (no prototype release)"}
        # clients with the same privacy events spend the same epsilon: account each distinct
        # ledger once (a PLD composition costs ~20 ms, i.e. 20 s a round at 1000 clients)
        memo: dict[str, float | None] = {}
        eps: dict[str, float | None] = {}
        for c in self.clients:
            key = c.ledger.fingerprint()
            if key not in memo:
                memo[key] = c.ledger.epsilon_spent()
            eps[c.data.name] = memo[key]
        status: dict[str, Any] = {"epsilon_spent": eps}
        last = [r for r in self.releases[-1] if r is not None] if self.releases else []
        overlaps = [
            r.diagnostics["partition_overlap"] for r in last if "partition_overlap" in r.diagnostics
        ]
        if overlaps:  # local-only diagnostic (computed on private data, never uploaded)
            status["partition_overlap"] = float(np.mean(overlaps))
        return status

    def guarantee(self) -> dict[str, Any]:
        """What this run's per-client guarantee covers (see :mod:`protofl.privacy.guarantee`)."""
        return describe_guarantee(
            self.config.privacy,
            noise_key=self.noise_mode,
            rounds=self.config.federation.rounds,
            clustered=self.method.cluster_fn() is not None,
            shares_weights=self.method.shares_weights,
            uses_prototypes=self.method.uses_prototypes,
        )

    def run(
        self, rounds: int | None = None, on_round: Callable[[RoundMetrics], None] | None = None
    ) -> list[RoundMetrics]:
        """Run the remaining rounds (or ``rounds`` of them)."""
        todo = self.config.federation.rounds - self.round if rounds is None else rounds
        for _ in range(todo):
            m = self.run_round()
            if on_round is not None:
                on_round(m)
        return list(self.history)

    # ----- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: models, optimisers, RNGs, ledgers, history."""
        return {
            "round": self.round,
            "method": self.method.state_dict(),
            "mechanism": self.mechanism.state_dict()
            if hasattr(self.mechanism, "state_dict")
            else {},
            "global_state": self.global_state,
            "server_gen": self.server_gen.get_state(),
            "public_counts": dict(self.public_counts),
            "history": [m.to_json() for m in self.history],
            "releases": [[release_to_dict(r) for r in rr] for rr in self.releases],
            "clients": [
                {
                    "model": c.model.state_dict(),
                    "optimizer": c.optimizer.state_dict(),
                    "state": c.state.tensors,
                    "ledger": c.ledger.state_dict(),
                    "train_gen": c.train_gen.get_state(),
                    "noise_gen": c.noise_gen.get_state(),
                    "dcr": None if c.dcr is None else c.dcr.state_dict(),
                }
                for c in self.clients
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (the data must be rebuilt from the same config)."""
        if len(state["clients"]) != len(self.clients):
            raise ValueError(
                f"checkpoint has {len(state['clients'])} clients, the config builds "
                f"{len(self.clients)}"
            )
        self.round = int(state["round"])
        self.method.load_state_dict(state["method"])
        if hasattr(self.mechanism, "load_state_dict"):
            self.mechanism.load_state_dict(state["mechanism"])
        self.global_state = dict(state["global_state"])
        self.server_gen.set_state(state["server_gen"])
        self.public_counts = {int(k): int(v) for k, v in state.get("public_counts", {}).items()}
        self.history = [RoundMetrics.from_json(m) for m in state["history"]]
        self.releases = [[release_from_dict(r) for r in rr] for rr in state["releases"]]
        for c, cs in zip(self.clients, state["clients"]):
            c.model.load_state_dict(cs["model"])
            c.optimizer.load_state_dict(cs["optimizer"])
            c.state.tensors = dict(cs["state"])
            c.ledger.load_state_dict(cs["ledger"])
            c.train_gen.set_state(cs["train_gen"])
            c.noise_gen.set_state(cs["noise_gen"])
            if c.dcr is not None:
                c.dcr.load_state_dict(cs["dcr"])


def release_to_dict(release: Release | None) -> dict[str, Any] | None:
    """A Release as plain containers (safe for ``torch.load(weights_only=True)``)."""
    if release is None:
        return None
    return {
        "prototypes": release.prototypes,
        "classes": release.classes,
        "counts": release.counts,
        "sensitivity": release.sensitivity,
        "noise_std": release.noise_std,
        "mechanism": release.mechanism,
        "events": release.events,
        "info": release.info,
        "diagnostics": release.diagnostics,
    }


def release_from_dict(data: dict[str, Any] | None) -> Release | None:
    """Inverse of :func:`release_to_dict`."""
    return None if data is None else Release(**data)


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
        "holdout_acc": last.holdout_acc,
    }


def initial_loss(sim: Simulation) -> float:
    """Mean cross-entropy of the untrained clients on their training data (a baseline)."""
    vals = []
    with torch.no_grad():
        for c in sim.clients:
            _, logits = c.model(c.data.train_z.float())
            vals.append(float(F.cross_entropy(logits, c.data.train_y)))
    return float(np.mean(vals)) if vals else math.nan
