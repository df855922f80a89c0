"""Load a finished run folder and rebuild what the attacks need: releases and feature paths.

A run folder written by :func:`protofl.engine.runner.run_experiment` with ``run.save_releases``
holds ``config.yaml`` and ``artifacts.pt`` (what the server received: every round's releases
per client, client names, domains); the experimenter's ground truth, which never leaves a
client (the indices of each client's training samples in its domain's TRAIN split, the final
client model weights), is in ``client-artifacts.pt`` of the run's client-local folder
``<run_dir>.client-local/`` (:func:`protofl.engine.rundir.client_local_dir`; a run made before
that folder existed has both in ``artifacts.pt``).  From these the attacks rebuild, per
client:

* the data set (through the registry), the frozen backbone and the client's trainable model with
  its saved weights;
* the feature path phi = ``method.upload_features(model, backbone(x))``, the path whose outputs
  the engine averages into prototypes;
* members (the client's training samples) and non-members (its domain's TEST split).

A release of round r was made with the model at the start of round r.  ``artifacts.pt`` keeps only
the *final* models (after the last round, one local training phase past the last release), so the
attacks use, in this order: for round 1 the seeded initial model (rebuilt exactly as the engine
builds it), a per-round checkpoint ``checkpoint-<r-1>.pt`` when the run kept it (the simulator
and the Flower server keep ``federation.keep_checkpoints``, default 1), else the final model (an
approximation, reported as such in ``feature_path``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from protofl.config import ExperimentConfig
from protofl.seeding import Stream, derive_seed

REQUIRED_FILES = ("config.yaml", "artifacts.pt")
REQUIRED_KEYS = ("releases", "clients", "domains")
"""What ``artifacts.pt`` (the server's view) must hold."""
CLIENT_KEYS = ("train_indices", "models")
"""What the attacks take from the client side (``client-artifacts.pt``, or an older
``artifacts.pt``)."""


@dataclass
class RunArtifacts:
    """What a run saved for attacks."""

    run_dir: Path
    config: ExperimentConfig
    releases: list[list[dict[str, Any] | None]]
    clients: list[str]
    domains: list[str]
    train_indices: list[np.ndarray]
    models: list[dict[str, torch.Tensor]]
    summary: dict[str, Any] = field(default_factory=dict)
    model_cache: dict[int | None, Any] = field(default_factory=dict, repr=False)

    @property
    def rounds(self) -> int:
        """Number of rounds with saved releases."""
        return len(self.releases)

    def client_index(self, name: str) -> int:
        """Index of a client by name, failing with the valid names."""
        if name not in self.clients:
            raise ValueError(
                f"run {self.run_dir} has no client {name!r}; clients: {', '.join(self.clients)}"
            )
        return self.clients.index(name)

    def release(self, round_: int, client: int) -> dict[str, Any]:
        """The release of ``client`` (index) in round ``round_`` (1-based)."""
        if not 1 <= round_ <= self.rounds:
            raise ValueError(
                f"round={round_} is out of range; this run has rounds 1..{self.rounds}"
            )
        rel = self.releases[round_ - 1][client]
        if rel is None:
            raise ValueError(
                f"client {self.clients[client]!r} released no prototypes in round {round_} "
                f"(method {self.config.method.name!r})"
            )
        return rel


def load_run(run_dir: str | Path) -> RunArtifacts:
    """Read a run folder; fails naming what is missing (folder, files, keys, releases)."""
    path = Path(run_dir)
    if not path.exists():
        raise FileNotFoundError(f"run folder {path} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a run folder (not a directory)")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        hint = (
            " (the run was made with run.save_releases=false, or did not finish)"
            if "artifacts.pt" in missing
            else ""
        )
        raise FileNotFoundError(
            f"run folder {path} has nothing to attack: missing {', '.join(missing)}{hint}"
        )
    config = ExperimentConfig.from_yaml(path / "config.yaml")
    try:
        raw = torch.load(path / "artifacts.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # an unreadable or foreign file
        raise ValueError(f"{path / 'artifacts.pt'} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'artifacts.pt'} does not hold a dict of run artifacts")
    if raw.get("engine") == "flower":
        raise ValueError(
            f"{path / 'artifacts.pt'} holds what a Flower server received (the releases), not the "
            "client models and training indices the attacks need, which never leave a client; "
            "attack an in-process run of the same config (protofl run CONFIG) instead"
        )
    absent = [k for k in REQUIRED_KEYS if k not in raw]
    if absent:
        raise ValueError(f"{path / 'artifacts.pt'} lacks {', '.join(absent)}")
    releases = raw["releases"]
    if not any(r is not None for rnd in releases for r in rnd):
        raise ValueError(
            f"run {path} saved no prototype releases (method {config.method.name!r} releases none)"
        )
    local = raw if all(k in raw for k in CLIENT_KEYS) else _client_artifacts(path, raw)
    summary: dict[str, Any] = {}
    if (path / "summary.json").is_file():
        import json

        summary = json.loads((path / "summary.json").read_text())
    return RunArtifacts(
        run_dir=path,
        config=config,
        releases=releases,
        clients=list(raw["clients"]),
        domains=list(raw["domains"]),
        train_indices=[np.asarray(t, dtype=np.int64) for t in local["train_indices"]],
        models=list(local["models"]),
        summary=summary,
    )


def _client_artifacts(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The client side's ``client-artifacts.pt`` of the run in ``path`` (one-line errors)."""
    from protofl.engine.rundir import CLIENT_ARTIFACTS, client_local_dir

    file = client_local_dir(path) / CLIENT_ARTIFACTS
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: the attacks need the client models and training indices, which "
            "are kept client-side beside the run folder, never in it (copy that folder along "
            "with the run folder, or attack the run where it was made)"
        )
    try:
        local = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # an unreadable or foreign file
        raise ValueError(f"{file} cannot be read: {exc}") from None
    if not isinstance(local, dict) or any(k not in local for k in CLIENT_KEYS):
        raise ValueError(f"{file} lacks {', '.join(CLIENT_KEYS)}")
    if list(local.get("clients", raw["clients"])) != list(raw["clients"]):
        raise ValueError(f"{file} belongs to other clients than {path / 'artifacts.pt'}")
    return local


@dataclass
class ClientView:
    """One client rebuilt: its model, feature path, members and non-members."""

    index: int
    name: str
    domain: str
    model: nn.Module
    method: Any
    backbone: Any
    train_images: np.ndarray
    train_labels: torch.Tensor
    train_z: torch.Tensor
    test_images: np.ndarray
    test_labels: torch.Tensor
    test_z: torch.Tensor
    class_names: tuple[str, ...]

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def to(self, device: torch.device) -> ClientView:
        """Move the client model and the backbone to ``device`` (in place); returns self."""
        from protofl.models.device import move_attributes

        if device != self.device:
            self.model.to(device)
            move_attributes(self.backbone, device)
            self.device = device
        return self

    def phi_z(self, z: torch.Tensor) -> torch.Tensor:
        """phi on frozen representations (no gradient), on the CPU."""
        with torch.no_grad():
            return self.method.upload_features(self.model, z.to(self.device)).detach().cpu()

    def phi_images(self, x: torch.Tensor) -> torch.Tensor:
        """phi on float images [B, 3, S, S] in [0, 1], differentiable through the backbone
        (``x`` on the view's device)."""
        return self.method.upload_features(self.model, self.backbone.encode_batch(x))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(3, S, S) at the backbone's input size."""
        s = int(self.backbone.image_size)
        return (3, s, s)


def release_model_states(
    art: RunArtifacts, round_: int | None
) -> tuple[list[dict[str, torch.Tensor]] | None, str]:
    """The client weights that made the releases of ``round_`` and where they come from.

    ``None`` for round 1 means "the seeded initial model".
    """
    if round_ not in art.model_cache:
        art.model_cache[round_] = _release_model_states(art, round_)
    return art.model_cache[round_]  # type: ignore[no-any-return]


def _release_model_states(
    art: RunArtifacts, round_: int | None
) -> tuple[list[dict[str, torch.Tensor]] | None, str]:
    final = "final client models (after the last round)"
    if round_ is None or round_ > art.rounds:
        return art.models, final
    if round_ == 1:
        return None, "initial client models (exactly the models that made round 1's releases)"
    ckpt = art.run_dir / f"checkpoint-{round_ - 1:04d}.pt"
    if ckpt.is_file():
        try:
            state = torch.load(ckpt, map_location="cpu", weights_only=True)
            models = [c["model"] for c in state["clients"]]
            if len(models) == len(art.clients):
                return models, (
                    f"client models from {ckpt.name} (exactly the models that made round "
                    f"{round_}'s releases)"
                )
        except Exception:  # an unreadable or foreign checkpoint: fall back to the final models
            pass
    if round_ == art.rounds:
        return art.models, final + f"; round {round_}'s releases were made one local phase earlier"
    return (
        art.models,
        final
        + f"; round {round_}'s releases were made {art.rounds - round_ + 1} "
        + ("local phases earlier (approximate feature path)"),
    )


def rebuild_clients(
    art: RunArtifacts,
    names: list[str] | None = None,
    *,
    home: Path | None = None,
    round_: int | None = None,
) -> list[ClientView]:
    """Rebuild the named clients (default: all) of a saved run, with the models that made the
    releases of ``round_`` (see :func:`release_model_states`; default the final models)."""
    from protofl.data.cache import protofl_home
    from protofl.data.features import cached_features
    from protofl.engine.federated_data import load_dataset
    from protofl.methods import create_method
    from protofl.models.backbones import backbone_class

    cfg = art.config
    home = home or protofl_home()
    wanted = [art.client_index(n) for n in names] if names else list(range(len(art.clients)))
    backbone_cls = backbone_class(cfg.backbone)
    dataset = load_dataset(cfg, home)
    backbone = backbone_cls(cfg.backbone.image_size)
    domain_order = list(dict.fromkeys(art.domains))
    method = create_method(
        cfg.method.name,
        cfg.method.params,
        num_classes=dataset.num_classes,
        num_domains=len(domain_order),
        proto_dim=cfg.backbone.proto_dim,
        seed=cfg.seed,
    )
    use_cache = cfg.backbone.feature_cache
    states, _ = release_model_states(art, round_)
    init_seed = _init_seed(cfg.seed)
    views: list[ClientView] = []
    domain_cache: dict[str, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
    for i in wanted:
        dom = dataset.domain(art.domains[i])
        if dom.name not in domain_cache:
            # the union of the domain's clients' indices is the run's subsample (sorted), so the
            # frozen features are usually read from the run's own cache entry
            union = np.unique(
                np.concatenate(
                    [art.train_indices[j] for j, d in enumerate(art.domains) if d == dom.name]
                )
            )
            train_z = cached_features(
                home,
                backbone,
                dataset.name,
                dom.name,
                "train",
                dom.train.images[union],
                use_cache=use_cache,
            )
            test_z = cached_features(
                home,
                backbone,
                dataset.name,
                dom.name,
                "test",
                dom.test.images,
                use_cache=use_cache,
            )
            domain_cache[dom.name] = (union, train_z, test_z)
        union, train_z, test_z = domain_cache[dom.name]
        idx = art.train_indices[i]
        pos = np.searchsorted(union, idx)
        model = backbone_cls.client_model(
            backbone.feature_dim,
            dataset.num_classes,
            cfg.backbone,
            torch.Generator().manual_seed(init_seed),
            client=i,
        )
        if states is not None:
            model.load_state_dict(states[i])
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        views.append(
            ClientView(
                index=i,
                name=art.clients[i],
                domain=dom.name,
                model=model,
                method=method,
                backbone=backbone,
                train_images=dom.train.images[idx],
                train_labels=torch.from_numpy(dom.train.labels[idx].astype(np.int64)),
                train_z=train_z[torch.from_numpy(pos)],
                test_images=dom.test.images,
                test_labels=torch.from_numpy(dom.test.labels.astype(np.int64)),
                test_z=test_z,
                class_names=tuple(dataset.classes),
            )
        )
    return views


def _init_seed(seed: int) -> int:
    """The engine's client-initialisation seed (the ``INIT`` stream)."""

    return derive_seed(seed, Stream.INIT)


def run_facts(art: RunArtifacts, round_: int) -> dict[str, Any]:
    """Context written next to attack results."""
    cfg = art.config
    return {
        "run_dir": str(art.run_dir),
        "dataset": cfg.data.name,
        "method": cfg.method.name,
        "mechanism": cfg.privacy.mechanism,
        "epsilon": cfg.privacy.epsilon if cfg.privacy.mechanism != "none" else None,
        "delta": cfg.privacy.delta if cfg.privacy.mechanism != "none" else None,
        "round": round_,
        "rounds": art.rounds,
        "feature_path": release_model_states(art, round_)[1],
    }


def json_safe(value: Any) -> Any:
    """Nested dicts/lists with non-finite floats replaced by None (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, np.floating | np.integer):
        return json_safe(value.item())
    return value
