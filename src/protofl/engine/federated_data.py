"""Turn a configured data set into per-client cached features (the engine's only data view)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import protofl.models  # noqa: F401  (registers every backbone)
from protofl.config import ExperimentConfig
from protofl.data import DATASET_REGISTRY
from protofl.data.base import MultiDomainDataset
from protofl.data.features import cached_features
from protofl.data.partition import (
    PartitionError,
    dirichlet_label_split,
    dirichlet_split,
    equal_shards,
    subsample,
    validation_split,
)
from protofl.errors import ConfigError
from protofl.methods import create_method
from protofl.models.backbones import FrozenBackbone, backbone_class, check_backbone_options
from protofl.privacy import MECHANISM_REGISTRY
from protofl.progress import note
from protofl.seeding import DATA_TAG

log = logging.getLogger(__name__)

VALIDATION_KEY = 0x7A1
"""Key of the validation split's seed path ``(seed, DATA_TAG, VALIDATION_KEY, client)``."""


@dataclass
class ClientData:
    """One client's cached training representation and its domain's test set (with
    ``data.validation_fraction``: the client's own validation part of its training data, in
    ``test_z``/``test_y``; the test set is not read)."""

    client: int
    name: str
    domain: int
    domain_name: str
    train_z: torch.Tensor
    train_y: torch.Tensor
    test_z: torch.Tensor
    test_y: torch.Tensor
    train_indices: np.ndarray

    @property
    def num_train(self) -> int:
        """Number of local training samples."""
        return int(self.train_y.shape[0])


@dataclass
class FederatedData:
    """All clients, the label space and the domains."""

    clients: list[ClientData]
    classes: tuple[str, ...]
    domains: tuple[str, ...]
    feature_dim: int
    dataset: str
    real_domains: dict[str, bool]
    holdout: tuple[str, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_classes(self) -> int:
        """Size of the label space."""
        return len(self.classes)


def data_preset(config: ExperimentConfig) -> dict[str, Any]:
    """The values of ``data.preset`` for this data set (empty when no preset is named)."""
    if config.data.preset is None:
        return {}
    from protofl.data.allocation import preset_values

    return preset_values(config.data.preset, config.data.name)


def load_dataset(config: ExperimentConfig, home: Path) -> MultiDomainDataset:
    """Load the configured data set through the registry, passing ``data.options``.

    Loaders that accept them also get ``image_size`` (the backbone's input size, so large images
    are resized once at load), ``holdout_domain`` and the preset's ``protocol``.
    """
    info = DATASET_REGISTRY.get(config.data.name)
    params = inspect.signature(info.loader).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = dict(config.data.options)
    check_data_options(config.data.name, info.loader, kwargs)

    def offer(key: str, value: Any) -> None:
        if value is not None and (open_kwargs or key in params):
            kwargs.setdefault(key, value)

    offer("image_size", config.backbone.image_size)
    offer("holdout_domain", config.data.holdout_domain)
    offer("protocol", data_preset(config).get("protocol"))
    return info.loader(home, config.data.root, **kwargs)


def check_data_options(name: str, loader: Any, options: Mapping[str, Any]) -> None:
    """Every ``data.options`` key is a parameter of the data set's loader (checked without
    loading anything)."""
    params = inspect.signature(loader).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in options:
        if key not in params:
            raise ValueError(f"data set {name!r} has no option {key!r} (data.options.{key})")


def preflight(config: ExperimentConfig) -> None:
    """Everything about ``config`` that can be checked before a folder is made or data is
    loaded: the data set, its options, root and layout (an HF set's columns), the backbone and
    its options, the method and its parameters, the mechanism, the optional packages the run
    needs (``run.tensorboard``); every range was checked when the config was built.  The names
    are the registries' (no other list of them exists)."""
    from protofl.models.device import resolve_device

    resolve_device(config.run.device)  # run.device=cuda without a GPU: one line, nothing made
    info = DATASET_REGISTRY.get(config.data.name)
    check_data_options(config.data.name, info.loader, config.data.options)
    if config.data.allocation is None:
        _preset_allocation(config)  # a data preset's allocation against clients_per_domain
    if config.data.root is not None and not Path(config.data.root).exists():
        raise ValueError(f"data.root={config.data.root!r} does not exist")
    backbone_class(config.backbone)
    check_backbone_options(config.backbone.name, config.backbone.options)
    mechanism = MECHANISM_REGISTRY.get(config.privacy.mechanism)
    method = create_method(
        config.method.name,
        config.method.params,
        num_classes=10,
        num_domains=4,
        proto_dim=config.backbone.proto_dim,
    )
    check_run = getattr(mechanism, "check_run", None)
    if check_run is not None:  # what the mechanism's guarantee needs of the run (ddg)
        check_run(config, method)
    if config.run.tensorboard:
        check_tensorboard()
    if info.preflight is not None:  # the root's layout, an HF set's columns: nothing decoded
        info.preflight(config.data.root, dict(config.data.options))


def check_tensorboard() -> None:
    """``run.tensorboard`` without the package: one line naming the extra (nothing made)."""
    import importlib.util

    from protofl.extras import install_hint

    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "run.tensorboard=true needs the optional package tensorboard, which is not "
            f"installed: {install_hint('tensorboard')} (the extra 'tensorboard'), or set "
            "run.tensorboard=false"
        )


def _preset_allocation(config: ExperimentConfig) -> Any:
    """The data preset's allocation (None without one); refuses ``data.clients_per_domain``
    when that allocation fixes the clients of each domain itself."""
    spec = data_preset(config).get("allocation")
    if spec not in (None, "equal") and config.data.clients_per_domain != 1:
        raise ValueError(
            f"data.clients_per_domain={config.data.clients_per_domain} has no effect under "
            f"data.preset={config.data.preset!r}, whose allocation {spec!r} sets the clients "
            "of each domain: set data.allocation=equal to use it"
        )
    return spec


def client_counts(config: ExperimentConfig, dataset: str, domains: list[str]) -> dict[str, int]:
    """Clients per domain: ``data.allocation`` (a preset name or ``dom:count,...``), the
    preset's allocation, or ``data.clients_per_domain`` each."""
    spec: Any = config.data.allocation
    if spec is None:
        spec = _preset_allocation(config)
    if spec is None:
        return {d: config.data.clients_per_domain for d in domains}
    from protofl.data.allocation import resolve_allocation

    if isinstance(spec, str) and ":" in spec:
        try:
            spec = {k.strip(): int(v) for k, v in (p.split(":") for p in spec.split(","))}
        except ValueError:
            raise ValueError(
                f"data.allocation={config.data.allocation!r}: write a preset name or "
                "'domain:count,domain:count'"
            ) from None
    return dict(resolve_allocation(spec, domains, config.data.clients_per_domain, dataset))


def fraction_line(
    dataset: str,
    fraction: float,
    used: int,
    available: int,
    clients: int,
    *,
    per_client: bool = False,
    preset: str | None = None,
    items: str = "images",
) -> str:
    """The console line of a run that trains on a fraction of its data (``train_fraction`` < 1,
    the default 0.1): how many of the training ``items`` (images, texts) it uses and which key
    sets it."""
    unit = " of its domain per client" if per_client else ""
    key = f"set by data.preset {preset}" if preset else "data.train_fraction; 1 uses them all"
    return (
        f"data: {dataset}, train_fraction {fraction:g}{unit}: {used} of {available} training "
        f"{items} used by {clients} client(s) ({key})"
    )


def _rows(z: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    """``z[idx]``, as a view (no copy: it shares the memory-mapped cache) when ``idx`` is a
    contiguous ascending range, else a copy of those rows."""
    if len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
        return z[int(idx[0]) : int(idx[0]) + len(idx)]
    return z[torch.from_numpy(np.asarray(idx, dtype=np.int64))]


def build_federated_data(
    config: ExperimentConfig,
    home: Path,
    *,
    backbone: FrozenBackbone | None = None,
    dataset: MultiDomainDataset | None = None,
) -> FederatedData:
    """Subsample each domain's train split, assign clients, and encode with the cached backbone.

    With ``data.validation_fraction`` every client's training rows are split (stratified, seeded
    by the experiment seed and the client) into training and validation, and the validation rows
    take the test set's place: no test image is encoded or read, and there is no held-out
    domain evaluation. The draws that choose the training rows are the same as without it.
    """
    dcfg = config.data
    validation = dcfg.validation_fraction
    # the backbone's name and options are checked before any data is loaded
    backbone_cls = backbone_class(config.backbone) if backbone is None else None
    dataset = dataset or load_dataset(config, home)
    if backbone is None:
        assert backbone_cls is not None
        backbone = backbone_cls(config.backbone.image_size)
    domains = list(dataset.domains)
    if dcfg.domains is not None:
        domains = [dataset.domain(name) for name in dcfg.domains]
    holdout = None
    if dcfg.holdout_domain is not None:
        holdout = dataset.domain(dcfg.holdout_domain)
        domains = [d for d in domains if d.name != holdout.name]
        if not domains:
            raise ValueError("data.holdout_domain leaves no domain to train on")
    counts = client_counts(config, dataset.name, [d.name for d in domains])
    preset = data_preset(config)
    fraction = float(preset.get("train_fraction", dcfg.train_fraction))
    per_client_fraction = (dcfg.fraction_unit or preset.get("fraction_unit")) == "client"
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, DATA_TAG]))
    clients: list[ClientData] = []
    cache_opts: dict[str, Any] = {
        "use_cache": config.backbone.feature_cache,
        "dtype": config.backbone.feature_dtype,
        "device": config.run.device,  # where uncached features are encoded
    }
    used = available = 0  # training images drawn, and in the domains' train splits
    for d_index, dom in enumerate(domains):
        if len(dom.train) == 0 or len(dom.test) == 0:
            raise ValueError(f"data set {dataset.name!r}: domain {dom.name!r} has an empty split")
        k = counts[dom.name]
        if k == 0:
            continue
        drawn: list[np.ndarray] = []
        if per_client_fraction:
            # FedDAP: every client draws the fraction of its domain (disjoint shards)
            from protofl.data.allocation import per_client_fraction_shards

            drawn = per_client_fraction_shards(np.arange(len(dom.train)), k, fraction, rng)
            train_idx = np.sort(np.concatenate(drawn))
        else:
            train_idx = subsample(
                dom.train.labels, fraction, rng, max_count=dcfg.max_train_per_domain
            )
        test_idx = np.arange(len(dom.test))
        if dcfg.max_test_per_domain is not None and len(test_idx) > dcfg.max_test_per_domain:
            test_idx = np.sort(rng.choice(test_idx, dcfg.max_test_per_domain, replace=False))
        train_images = dom.train.images[train_idx]
        train_z = cached_features(
            home, backbone, dataset.name, dom.name, "train", train_images, **cache_opts
        )
        train_y_all = dom.train.labels[train_idx].astype(np.int64)
        checked = [(train_y_all, "train")]
        if validation is None:
            test_images = dom.test.images[test_idx]
            test_z = cached_features(
                home, backbone, dataset.name, dom.name, "test", test_images, **cache_opts
            )
            test_y = torch.from_numpy(dom.test.labels[test_idx].astype(np.int64))
            checked.append((test_y.numpy(), "test"))
        for labels, name in checked:
            bad = (labels < 0) | (labels >= dataset.num_classes)
            if bad.any():
                raise ValueError(
                    f"data set {dataset.name!r}, domain {dom.name!r}, {name} split: "
                    f"{int(bad.sum())} labels outside 0..{dataset.num_classes - 1}"
                )
        local = np.arange(len(train_idx))
        if per_client_fraction:
            position = {int(v): i for i, v in enumerate(train_idx)}
            shards = [np.array([position[int(v)] for v in d], dtype=np.int64) for d in drawn]
        elif k == 1:
            shards = [local]
        elif dcfg.partition in ("dirichlet", "dirichlet_labels"):
            split = dirichlet_split if dcfg.partition == "dirichlet" else dirichlet_label_split
            shards = split(
                local, train_y_all, k, dcfg.dirichlet_alpha, rng, min_size=dcfg.min_client_size
            )
        else:
            shards = equal_shards(local, k, rng)
        for j, shard in enumerate(shards):
            cid = len(clients)
            name = dom.name if k == 1 else f"{dom.name}-{j}"
            if validation is not None:
                split_rng = np.random.default_rng(
                    np.random.SeedSequence([config.seed, DATA_TAG, VALIDATION_KEY, cid])
                )
                try:
                    keep, held = validation_split(train_y_all[shard], validation, split_rng)
                except PartitionError:
                    raise ValueError(
                        f"data.validation_fraction={validation!r} holds out no sample of client "
                        f"{name!r} ({len(shard)} training samples); use a larger fraction"
                    ) from None
                test_z = _rows(train_z, shard[held])
                test_y = torch.from_numpy(train_y_all[shard[held]])
                shard = shard[keep]
            clients.append(
                ClientData(
                    client=cid,
                    name=name,
                    domain=d_index,
                    domain_name=dom.name,
                    train_z=_rows(train_z, shard),
                    train_y=torch.from_numpy(train_y_all[shard]),
                    test_z=test_z,
                    test_y=test_y,
                    train_indices=train_idx[shard],
                )
            )
        used += len(train_idx)
        available += len(dom.train)
        log.info(
            "domain %s: %d train (of %d), %d test, %d client(s)",
            dom.name,
            len(train_idx),
            len(dom.train),
            len(test_idx),
            k,
        )
    if fraction < 1:
        line = fraction_line(
            dataset.name,
            fraction,
            used,
            available,
            len(clients),
            per_client=per_client_fraction,
            preset=dcfg.preset if "train_fraction" in preset else None,
            items=getattr(backbone, "items", "images"),
        )
        log.info("%s", line)
        note(line)  # the console of a run that shows progress
    holdout_data = None
    if holdout is not None and validation is None:
        h_idx = np.arange(len(holdout.test))
        if dcfg.max_test_per_domain is not None and len(h_idx) > dcfg.max_test_per_domain:
            h_idx = np.sort(rng.choice(h_idx, dcfg.max_test_per_domain, replace=False))
        h_z = cached_features(
            home,
            backbone,
            dataset.name,
            holdout.name,
            "test",
            holdout.test.images[h_idx],
            **cache_opts,
        )
        holdout_data = (
            holdout.name,
            h_z,
            torch.from_numpy(holdout.test.labels[h_idx].astype(np.int64)),
        )
    return FederatedData(
        holdout=holdout_data,
        clients=clients,
        classes=dataset.classes,
        domains=tuple(d.name for d in domains),
        feature_dim=backbone.feature_dim,
        dataset=dataset.name,
        real_domains={d.name: d.real for d in domains},
    )


def data_on_device(data: FederatedData, device: torch.device) -> FederatedData:
    """``data`` with every client's features and labels on ``device`` (itself on the CPU: the
    memory-mapped cache stays mapped).  A tensor several clients share (their domain's test set)
    is copied once."""
    if device.type == "cpu":
        return data
    moved: dict[int, torch.Tensor] = {}

    def on(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            moved[id(t)] = t.to(device)
        return moved[id(t)]

    clients = [
        replace(
            cd,
            train_z=on(cd.train_z),
            train_y=on(cd.train_y),
            test_z=on(cd.test_z),
            test_y=on(cd.test_y),
        )
        for cd in data.clients
    ]
    holdout = None
    if data.holdout is not None:
        name, hz, hy = data.holdout
        holdout = (name, on(hz), on(hy))
    return replace(data, clients=clients, holdout=holdout)
