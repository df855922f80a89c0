"""The in-process simulator: deterministic rounds of release -> aggregate -> train -> evaluate.

The server-side steps of a round are :mod:`protofl.engine.round`'s (shared with the Flower
strategy); this module holds the clients and runs their side, one after another or batched
(:mod:`protofl.engine.batched`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protofl.config import ExperimentConfig
from protofl.engine.client import Client
from protofl.engine.federated_data import FederatedData, data_on_device
from protofl.engine.norms import feature_norm_stats
from protofl.engine.optimizers import make_optimizer
from protofl.engine.round import (
    RoundMetrics,
    combine_weights,
    eval_subsample,
    missing_classes,
    privacy_status,
    run_round,
    select_participants,
    validate_uploads,
)
from protofl.engine.secure_sum import bind_secure_sum, secure_uploads, uses_secure_sum
from protofl.methods import create_method
from protofl.methods.base import Batch, ClientState, GlobalState, Method, Upload
from protofl.methods.objectives import Group
from protofl.models.backbones import backbone_class
from protofl.models.client import ClientModel, copy_client_model
from protofl.models.device import (
    autocast,
    describe_device,
    prepare_device,
    to_cpu_once,
    to_device,
)
from protofl.privacy import create_mechanism
from protofl.privacy.base import Mechanism, Release, release_from_dict, release_to_dict
from protofl.privacy.client import PrivateClient, release_many
from protofl.privacy.guarantee import describe_guarantee
from protofl.privacy.noise import noise_key, resolve_noise_mode
from protofl.seeding import Stream, derive_seed, generator

log = logging.getLogger(__name__)

EVAL_BATCH = 2048

UploadHook = Callable[["Simulation", "Client", torch.Tensor, Release], None]
"""A local-only diagnostic run on each release as sent (see ``Simulation.upload``)."""


class Simulation:
    """Holds clients, server method state and the mechanism; ``run_round`` advances one round."""

    def __init__(
        self,
        config: ExperimentConfig,
        data: FederatedData,
        *,
        deployment: bool = False,
        upload_hooks: Sequence[UploadHook] = (),
        state_dir: Path | None = None,
    ) -> None:
        self.config = config
        # called with (simulation, client, released features, release as sent) after each
        # release: local-only diagnostics the runner wires in (membership inference)
        self.upload_hooks = list(upload_hooks)
        # derived (reproducible; whoever holds the config can remove the noise) or secret
        self.noise_mode = resolve_noise_mode(config.privacy.noise_seed, deployment=deployment)
        # run.device: models, optimiser state, client features and the global state live there;
        # every generator stays on the CPU (what is drawn is moved), and the mechanism releases
        # on the CPU from the features the device computed (see :meth:`upload`)
        self.device = prepare_device(config.run.device)
        self.amp = config.run.amp
        if self.device.type != "cpu":
            log.info("computing on %s (%s)", self.device, describe_device(self.device)["name"])
        self.data = data_on_device(data, self.device)
        data = self.data
        fed = config.federation
        self.method: Method = create_method(
            config.method.name,
            config.method.params,
            num_classes=data.num_classes,
            num_domains=len(data.domains),
            proto_dim=config.backbone.proto_dim,
            seed=config.seed,
            rounds=fed.rounds,
        )
        # where the method's own server-side training runs (FedTGP's prototypes, MPFT's head)
        self.method.device = self.device
        if self.method.needs_domain and any(c.domain < 0 for c in data.clients):
            raise ValueError(f"method {self.method.name!r} needs every client to report a domain")
        # calibrated for the releases a client makes (privacy.release_schedule=once: one)
        self.mechanism: Mechanism = create_mechanism(
            config.privacy,
            rounds=config.privacy.releases(fed.rounds),
            dim=config.backbone.proto_dim,
        )
        self.global_state: GlobalState = {}
        self.round = 0
        backbone_cls = backbone_class(config.backbone)
        init_seed = derive_seed(config.seed, Stream.INIT)
        self.clients: list[Client] = []
        # identical frozen parameters (a frozen projection, frozen transformer blocks) are held
        # once for all clients instead of once per client; trainable ones stay per client
        from protofl.engine.store import FrozenParameterPool

        self.frozen_pool = FrozenParameterPool()
        self.batched: Any = None
        unknown = set(config.federation.poison) - {cd.name for cd in data.clients}
        if unknown:
            raise ValueError(
                f"federation.poison names unknown client(s) {sorted(unknown)}; clients: "
                + ", ".join(cd.name for cd in data.clients)
            )
        # run.client_state=disk: the batched store lives in memory-mapped files (state_dir, or
        # a temporary folder removed with the simulation) and each client is adopted into it as
        # it is built, so resident memory never holds the population's parameters at once
        self.state_dir: Path | None = None
        if config.run.client_state == "disk":
            # a simulation that fails while building its clients leaves no folder it made
            made = state_dir is None or not state_dir.exists()
            self.state_dir = state_dir or Path(tempfile.mkdtemp(prefix="protofl-client-state-"))
            if state_dir is None:
                weakref.finalize(self, shutil.rmtree, str(self.state_dir), True)
            try:
                self._build_clients(backbone_cls, init_seed)
            except BaseException:
                if made:
                    shutil.rmtree(self.state_dir, ignore_errors=True)
                raise
        else:
            self._build_clients(backbone_cls, init_seed)
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
        if uses_secure_sum(self.mechanism):  # ddg: calibrated for this federation
            bind_secure_sum(self.mechanism, config, self.method, [c.data for c in self.clients])
        self.releases: list[list[Release | None]] = []
        self.last_feature_norms: dict[str, dict[str, float]] = {}
        self.last_mia: dict[str, dict[str, float]] = {}
        self.history: list[RoundMetrics] = []
        self.server_gen = generator(config.seed, Stream.SERVER)
        # local-only diagnostics (computed on private data) are kept; a deployed client sends none
        self.diagnostics = True
        # with noisy add/remove counts, the server weights a client by the sum of its last noisy
        # counts (post-processing), never by the exact count
        self.public_counts: dict[int, int] = {}
        # federation.eval_samples: each test set's fixed subsample (by the set's identity)
        self._eval_sets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _build_clients(self, backbone_cls: Any, init_seed: int) -> None:
        """Build every client (with ``run.client_state=disk``, adopting each into the mapped
        store as it is built)."""
        config, data, fed = self.config, self.data, self.config.federation
        # clients whose fresh models are identical (Backbone.client_model_key) copy one template
        templates: dict[int, ClientModel] = {}
        for cd in data.clients:
            key = backbone_cls.client_model_key(cd.client)
            template = templates.get(key) if key is not None else None
            if template is None:
                model: ClientModel = backbone_cls.client_model(  # type: ignore[assignment]
                    data.feature_dim,
                    data.num_classes,
                    config.backbone,
                    torch.Generator().manual_seed(init_seed),
                    client=cd.client,
                )
                if key is not None:
                    templates[key] = model
                    model = copy_client_model(model)
            else:
                model = copy_client_model(template)
            if self.device.type != "cpu":  # built on the CPU
                model.to(self.device)
            self.frozen_pool.share(model)
            opt = make_optimizer(model.trainable_parameters(), fed)
            self.clients.append(
                Client(
                    data=cd,
                    model=model,
                    optimizer=opt,
                    state=ClientState(),
                    train_gen=generator(config.seed, Stream.TRAIN, cd.client),
                    privacy=PrivateClient(
                        config.privacy,
                        mechanism=self.mechanism,
                        key=noise_key(self.noise_mode, config.seed, cd.client),
                        name=cd.name,
                        head=model.head,
                    ),
                )
            )
            if self.state_dir is not None:
                self._offload(self.clients[-1])
        if self.state_dir is not None:
            self._check_offload()

    # ----- run.client_state=disk ---------------------------------------------------------------
    def _offload(self, c: Client) -> None:
        """Move ``c``'s trainable parameters (and DCR teacher) into the mapped store now.

        With the first client the batched trainer is made and ``run.memory_budget_mb``, when
        set, checked against every client's working memory (it follows from the first model's
        shapes and the clients' data), before the store's files are created: a refused run
        builds one client and writes nothing."""
        from protofl.engine.batched import BatchedTrainer

        if self.batched is None:
            self.batched = BatchedTrainer(
                self, memory_budget=self.memory_budget(), state_dir=self.state_dir
            )
            if not self.batched.supported:
                raise ValueError(
                    f"run.client_state=disk needs a run the batched executor can train: "
                    f"{self.batched.reason}"
                )
            self.batched.check_budget_of(self.data.clients)
        self.batched._ensure_store().adopt_all([c], optimizer=False)

    def _check_offload(self) -> None:
        """After the last client is built: the whole population can batch (one client's
        working memory was checked against ``run.memory_budget_mb`` before the first was
        written, see :meth:`_offload`)."""
        trainer = self.batched
        problem = trainer._check_clients(self.clients)
        if problem is not None:
            raise ValueError(
                f"run.client_state=disk needs a run the batched executor can train: {problem}"
            )
        trainer.projections = trainer.frozen_projections(self.clients)

    def memory_budget(self) -> int | None:
        """Bytes one group of batched clients may use (``run.memory_budget_mb``); None: the
        batched trainer's default, which never refuses a run."""
        mb = self.config.run.memory_budget_mb
        return None if mb is None else mb * 2**20

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
        """Which clients take part this round (:func:`protofl.engine.round.select_participants`)."""
        return select_participants(self.config.federation, len(self.clients), self.server_gen)

    def batched_trainer(self) -> Any:
        """The :class:`~protofl.engine.batched.BatchedTrainer` when ``federation.execution`` is
        ``batched`` and this run can batch (else None: the sequential paths run; the trainer
        logs why once)."""
        if self.config.federation.execution != "batched":
            return None
        if self.batched is None:
            from protofl.engine.batched import BatchedTrainer

            self.batched = BatchedTrainer(self, memory_budget=self.memory_budget())
            # a budget the user set below one client is refused, as with run.client_state=disk
            # (there when the simulation is built, here before the first round trains)
            if self.batched.supported:
                self.batched.check_budget(self.clients)
        return self.batched if self.batched.supported else None

    def collect_uploads(self, active: Sequence[bool] | None = None) -> list[Upload]:
        """Every active client computes features with its current model and releases prototypes.

        A client that does not take part releases nothing and is charged nothing.  In batched
        execution the executor computes every client's features at once
        (``BatchedTrainer.features_many``) and the mechanism releases them vectorised; the
        upload loop (:meth:`upload`: ledger, diagnostics, hooks, poison) is this one either way.
        """
        trainer = self.batched_trainer()
        if trainer is not None and self.method.default_upload_features:
            return self.upload(active, trainer.features_many, vectorise=True)
        return self.upload(active, self.upload_features, vectorise=False)

    def upload_features(self, clients: Sequence[Client]) -> list[torch.Tensor]:
        """``method.upload_features`` of each client's training inputs (eval mode, no grad)."""
        out = []
        for c in clients:
            c.model.eval()
            with torch.no_grad():
                out.append(self.method.upload_features(c.model, c.data.train_z.float()))
        return out

    def upload(
        self,
        active: Sequence[bool] | None,
        features_of: Callable[[Sequence[Client]], list[torch.Tensor]],
        *,
        vectorise: bool,
    ) -> list[Upload]:
        """The round's releases, whichever executor computed the features: the mechanism
        releases every active client's prototypes (``vectorise``: all at once, see
        :meth:`~protofl.privacy.base.Mechanism.release_many`), each ledger is charged, the
        local-only diagnostics and upload hooks run, and poisoned clients (attack simulation)
        send their release flipped and scaled."""
        chosen = [c for i, c in enumerate(self.clients) if active is None or active[i]]
        norms: dict[str, dict[str, float]] = {}
        self.last_feature_norms = norms
        self.last_mia = {}
        sent: dict[int, Release | None] = {}
        if self.method.uses_prototypes and chosen:
            # the release is computed on the CPU whatever run.device is: the features the device
            # computed are copied over, and the mechanism (clipping, prototypes, noise from the
            # clients' CPU generators) is the CPU code, so a noise key means the same everywhere
            feats = [f.cpu() for f in features_of(chosen)]
            # each client's ledger is charged with its release before anything is sent
            releases = release_many(
                [c.privacy for c in chosen],
                feats,
                [c.data.train_y.cpu() for c in chosen],
                num_classes=self.data.num_classes,
                round_index=self.round,
                cluster_fn=self.method.cluster_fn(),
                vectorise=vectorise,
            )
            if uses_secure_sum(self.mechanism):
                # ddg: the server sees only the sum of the shares (no per-client release, no
                # hooks on one); every share was charged to its client's ledger above
                for c, f in zip(chosen, feats):
                    norms[c.data.name] = feature_norm_stats(f, clip=self.config.privacy.clip)
                    sent[c.data.client] = None
                return self.record_uploads(sent, active, secure_uploads(self.mechanism, releases))
            for c, f, release in zip(chosen, feats, releases):
                # a local diagnostic (VPDR Fig. 4a): never uploaded, not covered by the DP claim
                norms[c.data.name] = feature_norm_stats(f, clip=self.config.privacy.clip)
                scale = self.config.federation.poison.get(c.data.name)
                if scale is not None:
                    # attack simulation (robust-aggregation experiments): after its honest
                    # release, this client sends its prototypes flipped and scaled
                    release = replace(release, prototypes=-float(scale) * release.prototypes)
                for hook in self.upload_hooks:
                    hook(self, c, f, release)
                sent[c.data.client] = release
        return self.record_uploads(sent, active)

    def record_uploads(
        self,
        sent: dict[int, Release | None],
        active: Sequence[bool] | None,
        sums: Sequence[Upload] = (),
    ) -> list[Upload]:
        """The round's uploads from what each active client sent (keyed by client id), in
        client order, then the decoded secure ``sums`` (ddg); the round's row of
        ``self.releases`` (None for a client that sat out or whose share only the sum shows)."""
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
                    extras=self.upload_extras(c),
                )
            )
        self.releases.append(round_releases)
        return uploads + list(sums)

    def upload_extras(self, c: Client) -> dict[str, torch.Tensor]:
        """What the method has ``c`` send beside its release (``Method.upload_extras``, in eval
        mode, no grad): unprotected, listed in the privacy statement."""
        if not self.method.extra_uploads:
            return {}
        c.model.eval()
        with torch.no_grad():
            return self.method.upload_extras(
                c.model, c.data.train_z.float(), c.data.train_y, c.state, c.data.client
            )

    def train_client(self, c: Client) -> float:
        """E local epochs of the method's objective (plus DCR); returns the mean batch loss.

        Anything in the client model that draws from torch's global generator (the ViT
        adapters' dropout) draws from a fork of it seeded by (seed, client, round), so runs and
        resumed runs repeat exactly; the global generator is left as it was.
        """
        # on a GPU its generator is forked too (dropout there draws from it; manual_seed seeds it)
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(
                derive_seed(self.config.seed, Stream.LOCAL_RNG, c.data.client, self.round)
            )
            return self._train_client(c)

    def _train_client(self, c: Client) -> float:
        fed = self.config.federation
        self.method.begin_local(c.model, c.state, self.global_state, c.data.client)
        c.model.train()
        n = c.data.num_train
        total, steps = 0.0, 0
        # the objective's input transform (FedRDN), prepared once for the round
        objective = self.method.objective()
        inputs = objective.inputs if objective is not None else None
        if inputs is not None:
            group = Group([c.state], [c.data.domain], self.data.num_classes, [c.data.client])
            prepared = inputs.prepare(self.global_state, group)
        for _ in range(fed.local_epochs):
            perm = torch.randperm(n, generator=c.train_gen)
            for start in range(0, n, fed.batch_size):
                idx = perm[start : start + fed.batch_size].to(self.device)
                z, y = c.data.train_z[idx].float(), c.data.train_y[idx]
                if inputs is not None:
                    ok = torch.ones(1, len(y), dtype=torch.bool, device=y.device)
                    z = inputs.train(z.unsqueeze(0), ok, prepared, slice(0, 1), steps)[0]
                with autocast(self.device, self.amp):
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
                loss = loss.float()
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"client {c.data.name!r}, round {self.round}: local loss is {loss.item()}"
                    )
                c.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if fed.grad_clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(c.model.parameters(), fed.grad_clip_norm)
                c.optimizer.step()
                if c.dcr is not None:
                    c.dcr.after_step(c.model.head)
                total += float(loss.detach())
                steps += 1
        if inputs is not None:
            inputs.finish(prepared, [steps])
        self.method.end_local(c.model, c.state, self.global_state, c.data.client)
        self.after_training(c)
        return total / max(steps, 1)

    def after_training(self, c: Client) -> None:
        """``Method.after_training`` with the client's training data, when the method uses it."""
        if not self.method.uses_training_data:
            return
        c.model.eval()
        with torch.no_grad():
            f = c.model.features(c.data.train_z.float())
        self.method.after_training(c.state, f, c.data.train_y)

    def train_active(self, clients: list[Client]) -> list[float]:
        """Local training of the round's participants: batched when configured and supported
        by the method (``federation.execution: batched``), else one client after another."""
        trainer = self.batched_trainer()
        if trainer is not None:
            return trainer.train(clients)  # type: ignore[no-any-return]
        return [self.train_client(c) for c in clients]

    def average_weights(self, active: Sequence[bool] | None = None) -> None:
        """The weights of the clients that trained, combined by ``federation.weight_aggregation``
        and the method's :meth:`~protofl.methods.base.Method.weight_plan`
        (:func:`protofl.engine.round.combine_weights`; FedAvg's sample-weighted mean of every
        tensor by default); sent to all."""
        fed = self.config.federation
        members = [c for i, c in enumerate(self.clients) if active is None or active[i]]
        counts = [self.public_count(c) for c in members]
        plan = self.method.weight_plan([c.data.client for c in members], counts)
        avg = combine_weights(
            plan,
            [c.model.state_dict() for c in members],
            counts,
            rule=fed.weight_aggregation,
            trim_ratio=fed.weight_trim_ratio,
            method=self.method.name,
        )
        for c in self.clients:
            # entries the plan keeps local (COPA's heads) are each client's own
            c.model.load_state_dict(avg, strict=not plan.local)
        self.global_state["__weights_round"] = torch.tensor(self.round)

    def test_set(self, c: Client, sample: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The test inputs and labels ``c`` is evaluated on: its domain's whole test set, or
        (``sample``) that set's fixed subsample of ``federation.eval_samples``, drawn once from
        the run's seed and the test set's domain and shared by every client of the set."""
        z, y = c.data.test_z, c.data.test_y
        if not sample or self.config.federation.eval_samples <= 0:
            return z, y
        key = id(z)
        if key not in self._eval_sets:
            gen = generator(self.config.seed, Stream.EVAL, max(c.data.domain, 0))
            idx = eval_subsample(len(y), self.config.federation.eval_samples, gen)
            if idx is None:
                self._eval_sets[key] = (z, y)
            else:
                self._eval_sets[key] = (z[idx.to(z.device)], y[idx.to(y.device)])
        return self._eval_sets[key]

    @torch.no_grad()
    def evaluate(
        self, sample: bool = False, clients: Sequence[Client] | None = None
    ) -> dict[str, float]:
        """Accuracy of every client (or of ``clients``: a Flower client evaluates itself) on
        its own domain's test set (fractions); ``sample``: on the set's fixed subsample
        (:meth:`test_set`)."""
        trainer = self.batched_trainer()
        if trainer is not None:
            if clients is None:  # a fused run's trainer evaluates its run's clients only
                return trainer.evaluate(sample)  # type: ignore[no-any-return]
            return trainer.evaluate(sample, clients)  # type: ignore[no-any-return]
        out: dict[str, float] = {}
        for c in self.clients if clients is None else clients:
            c.model.eval()
            test_z, test_y = self.test_set(c, sample)
            correct = 0
            for start in range(0, len(test_y), EVAL_BATCH):
                z = test_z[start : start + EVAL_BATCH].float()
                y = test_y[start : start + EVAL_BATCH]
                with autocast(self.device, self.amp):
                    pred = self.method.predict(c.model, z, self.global_state, c.state)
                correct += int((pred == y).sum())
            out[c.data.name] = correct / max(len(test_y), 1)
        return out

    @torch.no_grad()
    def evaluate_holdout(self, clients: Sequence[Client] | None = None) -> float | None:
        """Mean accuracy of all clients (or of ``clients``) on the held-out domain
        (leave-one-domain-out)."""
        if self.data.holdout is None:
            return None
        trainer = self.batched_trainer()
        if trainer is not None:
            if clients is None:
                return trainer.evaluate_holdout()  # type: ignore[no-any-return]
            return trainer.evaluate_holdout(clients)  # type: ignore[no-any-return]
        _, z, y = self.data.holdout
        accs = []
        for c in self.clients if clients is None else clients:
            c.model.eval()
            correct = 0
            for start in range(0, len(y), EVAL_BATCH):
                with autocast(self.device, self.amp):
                    pred = self.method.predict(
                        c.model, z[start : start + EVAL_BATCH].float(), self.global_state, c.state
                    )
                correct += int((pred == y[start : start + EVAL_BATCH]).sum())
            accs.append(correct / max(len(y), 1))
        return float(np.mean(accs))

    def run_round(self) -> RoundMetrics:
        """One full round (:func:`protofl.engine.round.run_round` with this run's own
        executor: sequential, or batched); returns its metrics."""
        (metrics,) = run_round([self], _OwnExecutor(self))
        return metrics

    def offload_state(self, clients: Sequence[Client]) -> None:
        """With ``run.client_state=disk``: move ``clients``' method state
        (``ClientState.tensors``) into the mapped store's per-key files
        (:meth:`~protofl.engine.store._Store.adopt_state`), so that it does not stay on the
        heap between rounds; a no-op otherwise."""
        if self.state_dir is not None and self.batched is not None:
            self.batched._ensure_store().adopt_state_all(clients)

    def page_out(self, clients: Sequence[Client] | None = None) -> None:
        """With ``run.client_state=disk``: drop ``clients``' state (default: every client's)
        from the resident set (it stays in the mapped files); a no-op otherwise."""
        if self.state_dir is not None and self.batched is not None:
            store = self.batched._ensure_store()
            store.page_out(None if clients is None else [store.row[c.data.client] for c in clients])

    def missing_classes(self, accepted: list[Upload]) -> list[int]:
        """Classes no accepted upload carries this round (reported, never invented)."""
        if not self.method.uses_prototypes or not accepted:
            return []
        return missing_classes(accepted, self.data.num_classes, self.round + 1)

    def validate(self, uploads: list[Upload]) -> tuple[list[Upload], list[dict[str, str]]]:
        """Server-side upload validation; rejected uploads are logged and left out."""
        # a decoded secure sum (client < 0) comes from no single client: nothing to check
        sums = [up for up in uploads if up.client < 0]
        accepted, rejected = validate_uploads(
            [up for up in uploads if up.client >= 0],
            names={c.data.client: c.data.name for c in self.clients},
            domains={c.data.client: c.data.domain for c in self.clients},
            num_classes=self.data.num_classes,
            dim=self.config.backbone.proto_dim,
            norm_bound=self.mechanism.norm_bound,
            one_per_class=self.method.cluster_fn() is None,
            round_number=self.round + 1,
        )
        return accepted + sums, rejected

    def privacy_status(self) -> dict[str, Any]:
        """Epsilon spent per client (None without a guarantee) and the release facts."""
        last = [r for r in self.releases[-1] if r is not None] if self.releases else []
        return privacy_status(
            {c.data.name: c.privacy.ledger for c in self.clients},
            uses_prototypes=self.method.uses_prototypes,
            partition_overlaps=[
                r.diagnostics["partition_overlap"]
                for r in last
                if "partition_overlap" in r.diagnostics
            ],
        )

    def guarantee(self) -> dict[str, Any]:
        """What this run's per-client guarantee covers (see :mod:`protofl.privacy.guarantee`)."""
        return describe_guarantee(
            self.config.privacy,
            noise_key=self.noise_mode,
            # the charged releases: with release_schedule=once one, from the initial model
            rounds=self.config.privacy.releases(self.config.federation.rounds),
            clustered=self.method.cluster_fn() is not None,
            shares_weights=self.method.shares_weights,
            uses_prototypes=self.method.uses_prototypes,
            other_uploads=self.method.extra_uploads,
            # every round's per-client accuracy is in metrics.jsonl, the server's view (of a
            # model that depends on the private data unless nothing trains on it)
            evaluation_reported=self.config.federation.local_epochs > 0
            or self.method.uses_training_data,
            # every client trains its adapter/projection between releases (local_epochs > 0)
            trained_feature_map=self.config.federation.local_epochs > 0,
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
        """Everything needed to continue exactly: models, optimisers, RNGs, ledgers, history.

        Tensors are CPU copies whatever ``run.device`` is (a checkpoint loads on any machine);
        ``device`` records where the run computed.  A tensor several entries view (a pooled
        frozen parameter, which every client's model holds) is copied once, so a checkpoint
        stores it once (``torch.save`` writes a storage once) on a GPU as on the CPU."""
        return to_cpu_once(self._state_dict())

    def _state_dict(self) -> dict[str, Any]:
        # a mapped store's method state: its files' rows saved once (never rows no client uses)
        if self.state_dir is not None and self.batched is not None:
            states = self.batched._ensure_store().state_checkpoint(self.clients)
        else:
            states = [c.state.tensors for c in self.clients]
        return {
            "round": self.round,
            "device": str(self.device),
            "method": self.method.state_dict(),
            "mechanism": self.mechanism.state_dict(),
            "global_state": self.global_state,
            "server_gen": self.server_gen.get_state(),
            "public_counts": dict(self.public_counts),
            "history": [m.to_json() for m in self.history],
            "releases": [[release_to_dict(r) for r in rr] for rr in self.releases],
            "clients": [
                {
                    "model": c.model.state_dict(),
                    "optimizer": c.optimizer.state_dict(),
                    "state": st,
                    "train_gen": c.train_gen.get_state(),
                    **c.privacy.state_dict(),  # ledger, noise key's state (never a secret), dcr
                }
                for c, st in zip(self.clients, states)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (the data must be rebuilt from the same config)."""
        if len(state["clients"]) != len(self.clients):
            raise ValueError(
                f"checkpoint has {len(state['clients'])} clients, the config builds "
                f"{len(self.clients)}"
            )
        # checkpoints written before run.device existed computed on the CPU
        previous = str(state.get("device", "cpu"))
        if previous != str(self.device):
            log.warning(
                "resuming a run that computed on %s on %s: results after round %d can differ "
                "from an uninterrupted run by float rounding (docs/performance.md, GPU)",
                previous,
                self.device,
                int(state["round"]),
            )
        self.round = int(state["round"])
        self.method.load_state_dict(state["method"])
        self.mechanism.load_state_dict(state["mechanism"])
        self.global_state = to_device(dict(state["global_state"]), self.device)
        self.server_gen.set_state(state["server_gen"])
        self.public_counts = {int(k): int(v) for k, v in state.get("public_counts", {}).items()}
        self.history = [RoundMetrics.from_json(m) for m in state["history"]]
        self.releases = [[release_from_dict(r) for r in rr] for rr in state["releases"]]
        for c, cs in zip(self.clients, state["clients"]):
            c.model.load_state_dict(cs["model"])
            c.optimizer.load_state_dict(cs["optimizer"])
            c.state.tensors = to_device(dict(cs["state"]), self.device)
            c.train_gen.set_state(cs["train_gen"])
            c.privacy.load_state_dict(cs, where="the checkpoint")
        self.offload_state(self.clients)
        self.page_out()


class _OwnExecutor:
    """The client side of one simulation's round (:class:`~protofl.engine.round.RoundExecutor`
    of run 0): its releases, local training and evaluation, sequential or batched."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def upload(self, active: Mapping[int, list[bool]]) -> dict[int, list[Upload]]:
        return {0: self.sim.collect_uploads(active[0])}

    def train(self, chosen: Mapping[int, list[Client]]) -> dict[int, list[float]]:
        return {0: self.sim.train_active(chosen[0])}

    def evaluate(self, samples: Mapping[int, bool]) -> dict[int, dict[str, float]]:
        return {r: self.sim.evaluate(sample) for r, sample in samples.items()}

    def scope(self, run: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


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
