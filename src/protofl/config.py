"""Frozen, validated configuration for a whole experiment; YAML in and out; dotted overrides."""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

import protofl.yamlio as yamlio
from protofl.errors import ConfigError
from protofl.presets import apply_preset, check_preset, difference
from protofl.privacy.config import PrivacyConfig
from protofl.registry import nearest

C = TypeVar("C")


CONFIG_SCHEMA = 2
"""Version of the config's layout; a run records it and is only resumed by the same schema
(2: ``privacy.noise_seed``)."""


def check_range(
    key: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ConfigError naming ``key`` when ``value`` lies outside the interval."""
    ok = True
    if low is not None:
        ok &= value > low if low_open else value >= low
    if high is not None:
        ok &= value < high if high_open else value <= high
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        interval = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
        raise ConfigError(f"{key}={value!r} is out of range; allowed: {interval}")


def check_choice(key: str, value: str, choices: Sequence[str]) -> None:
    """Raise ConfigError naming ``key`` when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ConfigError(
            f"{key}={value!r} is not allowed{nearest(value, list(choices))}; "
            f"choose one of: {', '.join(choices)}"
        )


BACKBONE_OPTION_CHECKS: list[Callable[[str, Mapping[str, Any]], None]] = []
"""Validators of ``backbone.options`` (``protofl.models.backbones`` adds its own on import; this
module never imports the backbones, which import it)."""

WEIGHT_RULES = ("mean", "median", "trimmed_mean")
"""How weight-sharing methods combine clients' weights (``federation.weight_aggregation``;
implemented by :func:`protofl.engine.round.average_weights`)."""


@dataclass(frozen=True)
class DataConfig:
    """Which data set, how it is split into clients, and how much of it trains."""

    name: str = "digits4"
    root: str | None = None
    domains: tuple[str, ...] | None = None
    train_fraction: float = 0.1
    max_train_per_domain: int | None = None
    max_test_per_domain: int | None = None
    clients_per_domain: int = 1
    partition: str = "domain"
    dirichlet_alpha: float = 0.5
    min_client_size: int = 1
    # a name (protofl.data.allocation) or a mapping {domain: clients}
    allocation: str | dict[str, int] | None = None
    preset: str | None = None
    # domain: a domain's clients share train_fraction of it; client: each client draws
    # train_fraction of its domain (FedDAP); None: the data preset's, else domain
    fraction_unit: str | None = None
    holdout_domain: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # hold out this share of every client's training data (stratified, seeded) and evaluate on
    # it instead of the test set, which is then never read (model selection); None: test
    validation_fraction: float | None = None

    def __post_init__(self) -> None:
        check_range("data.train_fraction", self.train_fraction, low=0.0, high=1.0, low_open=True)
        if self.validation_fraction is not None:
            check_range(
                "data.validation_fraction",
                self.validation_fraction,
                low=0.0,
                high=1.0,
                low_open=True,
                high_open=True,
            )
        check_range("data.clients_per_domain", self.clients_per_domain, low=1)
        if self.clients_per_domain != 1 and self.allocation not in (None, "equal"):
            raise ConfigError(
                f"data.clients_per_domain={self.clients_per_domain} has no effect under "
                f"data.allocation={self.allocation!r}, which sets the clients of each domain "
                "itself: set data.allocation=equal to use it, or drop data.clients_per_domain"
            )
        check_choice("data.partition", self.partition, ("domain", "dirichlet", "dirichlet_labels"))
        check_range("data.dirichlet_alpha", self.dirichlet_alpha, low=0.0, low_open=True)
        check_range("data.min_client_size", self.min_client_size, low=1)
        if self.fraction_unit is not None:
            check_choice("data.fraction_unit", self.fraction_unit, ("domain", "client"))
        for key in ("max_train_per_domain", "max_test_per_domain"):
            value = getattr(self, key)
            if value is not None:
                check_range(f"data.{key}", value, low=1)


@dataclass(frozen=True)
class BackboneConfig:
    """The frozen pretrained backbone and the trainable parts on top of it."""

    name: str = "efficientnet_lite0"
    image_size: int = 64
    proto_dim: int = 512
    adapter_hidden: int = 64
    train_projection: bool = True
    head: str = "linear"
    feature_cache: bool = True
    feature_dtype: str = "float32"  # float16: cached features held at half the memory
    # the backbone's own settings (a ViT checkpoint, adapt_last_k, ...); each backbone names the
    # ones it accepts (docs/backbones.md); they win over the older environment variables
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_range("backbone.image_size", self.image_size, low=8, high=512)
        check_choice("backbone.feature_dtype", self.feature_dtype, ("float32", "float16"))
        check_range("backbone.proto_dim", self.proto_dim, low=2)
        check_range("backbone.adapter_hidden", self.adapter_hidden, low=1)
        check_choice("backbone.head", self.head, ("linear", "mlp"))
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"backbone.options must be a mapping, got {self.options!r}")
        for key in self.options:
            if not isinstance(key, str):
                raise ConfigError(f"backbone.options: option names are strings, got {key!r}")
        if self.options and BACKBONE_OPTION_CHECKS:
            # the backbones own their options: protofl.models registers the check when it is
            # imported (preflight imports it and checks again before any run starts)
            for check in BACKBONE_OPTION_CHECKS:
                check(self.name, self.options)


OPTIMIZERS = ("adamw", "sgd")
"""Local optimisers (``federation.optimizer``)."""

WEIGHTINGS = ("samples", "uniform", "declared")
"""Where a client's aggregation weight comes from on the Flower engine
(``federation.weighting``; implemented by ``protofl.engine.flower.strategy``)."""


@dataclass(frozen=True)
class FederationConfig:
    """Rounds, local epochs and the local optimiser (AdamW as in VPDR's set-up, or SGD)."""

    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-5
    optimizer: str = "adamw"  # adamw | sgd (protofl.engine.optimizers)
    momentum: float = 0.9  # SGD's momentum; AdamW's beta1
    # clip each local step's gradient to this global L2 norm over the client's trainable
    # parameters (torch's clip_grad_norm_); 0: off (every paper's protocol).  A named deviation
    # for losses that diverge on frozen features under SGD (docs/methods.md)
    grad_clip_norm: float = 0.0
    participation: float = 1.0
    dropout: float = 0.0
    checkpoint: bool = True
    checkpoint_every: int = 1  # save after every k-th round (and the last); resume redoes <k
    # how many checkpoints the run folder keeps, the newest (0: all); 1 (default): the newest
    # alone (a corrupt newest one then cannot fall back to the previous: 2 keeps one to spare)
    keep_checkpoints: int = 1
    execution: str = "sequential"
    poison: dict[str, float] = field(default_factory=dict)  # client -> scale (robustness tests)
    # weight-sharing methods: mean (FedAvg, sample-weighted) | median | trimmed_mean (robust,
    # unweighted: a client's claimed size buys it nothing)
    weight_aggregation: str = "mean"
    weight_trim_ratio: float = 0.2
    # evaluation at scale: every k-th round (the last five rounds always, on the whole test
    # sets) on a fixed seeded subsample of each test set of this many samples (0: all of it)
    eval_every: int = 1
    eval_samples: int = 0
    # a client's aggregation weight on the Flower engine, whose server cannot see the data
    # (the in-process engine trusts its own clients and weights by their true counts):
    # samples (its sample count: the partition plan's where the server built it, else its
    # self-declared count capped at weight_cap x the lower median of the registered counts) |
    # uniform (every client alike) | declared (declared_counts, fixed by the operator; a node
    # registering another count is refused).  docs/distributed.md says what each defends
    weighting: str = "samples"
    weight_cap: float = 10.0  # a multiple of the median (>= 1); 0: no cap
    declared_counts: dict[str, int] = field(default_factory=dict)  # partition id -> samples

    def __post_init__(self) -> None:
        check_range("federation.rounds", self.rounds, low=1)
        check_range("federation.eval_every", self.eval_every, low=1)
        check_range("federation.eval_samples", self.eval_samples, low=0)
        check_range("federation.local_epochs", self.local_epochs, low=0)  # 0: no training
        check_range("federation.checkpoint_every", self.checkpoint_every, low=1)
        check_range("federation.keep_checkpoints", self.keep_checkpoints, low=0)
        check_range("federation.batch_size", self.batch_size, low=1)
        check_range("federation.lr", self.lr, low=0.0, low_open=True)
        check_range("federation.weight_decay", self.weight_decay, low=0.0)
        check_choice("federation.optimizer", self.optimizer, OPTIMIZERS)
        check_range("federation.momentum", self.momentum, low=0.0, high=1.0, high_open=True)
        check_range("federation.grad_clip_norm", self.grad_clip_norm, low=0.0)
        check_range(
            "federation.participation", self.participation, low=0.0, high=1.0, low_open=True
        )
        check_range("federation.dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_choice("federation.execution", self.execution, ("sequential", "batched"))
        check_choice("federation.weight_aggregation", self.weight_aggregation, WEIGHT_RULES)
        check_range(
            "federation.weight_trim_ratio",
            self.weight_trim_ratio,
            low=0.0,
            high=0.5,
            high_open=True,
        )
        for client, scale in self.poison.items():
            if not isinstance(scale, int | float) or isinstance(scale, bool):
                raise ConfigError(f"federation.poison.{client} must be a number, got {scale!r}")
        self._check_weighting()

    def _check_weighting(self) -> None:
        check_choice("federation.weighting", self.weighting, WEIGHTINGS)
        cap = self.weight_cap
        if cap != 0 and not cap >= 1:  # NaN fails too
            raise ConfigError(
                f"federation.weight_cap={cap!r} is out of range; allowed: 0 (no cap) or a "
                "multiple of the median >= 1"
            )
        counts: dict[str, int] = {}
        for key, value in self.declared_counts.items():
            part = str(key).strip()
            if isinstance(key, bool) or not part.isdigit():
                raise ConfigError(
                    f"federation.declared_counts: {key!r} is not a partition id (an integer "
                    ">= 0); write {partition id: sample count}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"federation.declared_counts.{part}={value!r}: a sample count is an "
                    "integer >= 1"
                )
            if str(int(part)) in counts:
                raise ConfigError(
                    f"federation.declared_counts: partition {int(part)} appears twice"
                )
            counts[str(int(part))] = value
        # string keys: the same in YAML, JSON (the run record) and a resumed run's config
        object.__setattr__(self, "declared_counts", dict(sorted(counts.items(), key=_as_int)))
        if self.weighting == "declared" and not counts:
            raise ConfigError(
                "federation.weighting=declared needs federation.declared_counts (partition id "
                "-> sample count, e.g. {0: 160, 1: 160})"
            )
        if counts and self.weighting != "declared":
            raise ConfigError(
                "federation.declared_counts is read only with federation.weighting=declared "
                f"(it is {self.weighting!r})"
            )


def _as_int(item: tuple[str, int]) -> int:
    return int(item[0])


@dataclass(frozen=True)
class MethodConfig:
    """The federated method and its hyperparameters (validated by the method itself)."""

    name: str = "fedproto"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    """Where results go and how the run behaves on this machine."""

    out_dir: str = "runs"
    save_releases: bool = True
    progress: bool = True
    tensorboard: bool = False
    # opt-in: protofl's Flower simulation clients send their local-only diagnostics (VPP's
    # partition overlap, the training loss) to the server; the guarantee then says NOT covered
    diagnostics: bool = False
    mia_every: int = 0  # run the membership-inference attack every k rounds (0: off)
    threads: int | None = None  # None: all cores for feature extraction, 1 for training
    # the headline accuracy: final (the last round, VPDR) | last5 (mean of the last 5, FedDAP)
    headline: str = "final"
    # where the rounds run: a name of protofl.engine.engines.ENGINE_REGISTRY (sim,
    # flower, ...), checked by preflight before anything is created
    engine: str = "sim"
    # where everything computes: auto (a GPU when torch sees one, else cpu) | cpu | cuda |
    # cuda:N; whether the GPU is there is checked when a run starts (protofl.models.device)
    device: str = "auto"
    # mixed precision of local training and evaluation: none | bf16 (autocast)
    amp: str = "none"
    # where clients' trainable state lives: memory | disk (memory-mapped files in the run
    # folder, paged in for the clients a round touches; needs federation.execution=batched)
    client_state: str = "memory"
    # working memory (MB) one group of batched clients may use; None: 256
    memory_budget_mb: int | None = None
    # warn once (console and run.log) when the run folder is projected to exceed this many GB
    # (the checkpoint size x checkpoints kept + the artifacts' estimate); 0: never
    disk_warn_gb: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not re.match(
            r"^(auto|cpu|cuda|cuda:\d+)$", self.device
        ):
            raise ConfigError(
                f"run.device={self.device!r}: write auto, cpu, cuda or cuda:N (N a GPU index)"
            )
        check_choice("run.amp", self.amp, ("none", "bf16"))
        check_choice("run.client_state", self.client_state, ("memory", "disk"))
        if self.memory_budget_mb is not None:
            check_range("run.memory_budget_mb", self.memory_budget_mb, low=1)
        if self.threads is not None:
            check_range("run.threads", self.threads, low=1)
        check_range("run.mia_every", self.mia_every, low=0)
        check_range("run.disk_warn_gb", self.disk_warn_gb, low=0.0)
        check_choice("run.headline", self.headline, ("final", "last5"))


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything one experiment needs; the same config and seed give the same numbers."""

    name: str = "default"
    seed: int = 0
    # a protocol (protofl.presets: vpdr | feddap | dp_testbed), filled in beneath the given values
    # when a config is read from a mapping; kept as a record of where the values came from
    preset: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        check_range("seed", self.seed, low=0)
        if self.preset is not None:
            check_preset(self.preset, self.data.name)
        if self.federation.weighting == "declared" and not self.privacy.counts_public:
            raise ConfigError(
                "federation.weighting=declared weights clients by exact sample counts, which "
                "privacy.neighbouring=add_remove with privacy.addremove_counts=noisy keeps "
                "private; use samples or uniform"
            )
        if self.run.client_state == "disk" and self.federation.execution != "batched":
            raise ConfigError(
                "run.client_state=disk keeps client state in a memory-mapped store the batched "
                f"executor trains in place; set federation.execution=batched (it is "
                f"{self.federation.execution!r})"
            )

    # --- conversion -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (YAML- and JSON-safe)."""
        return _to_plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        """The full resolved config as YAML."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> ExperimentConfig:
        """Build and validate from a nested mapping; unknown keys fail with the nearest name.
        A ``preset`` fills in the values the mapping does not give (protofl.presets)."""
        filled = apply_preset(
            data, default_dataset=DataConfig.name, default_method=MethodConfig.name
        )
        config = _build(cls, filled, prefix="", source=source)
        object.__setattr__(config, "_given", copy.deepcopy(dict(data)))  # for with_overrides
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> ExperimentConfig:
        """Read a YAML file; errors name the file and the key."""
        path = Path(path)
        if path.is_dir():
            hint = (
                " (a run folder: continue it with --resume)"
                if (path / "config.yaml").exists()
                else ""
            )
            raise ConfigError(f"config file {path} is a directory, not a YAML file{hint}")
        try:
            data = yamlio.load(path.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not a text (YAML) file") from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read ({exc.strerror})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        try:
            return cls.from_dict(data, source=str(path))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def with_overrides(self, overrides: Sequence[str]) -> ExperimentConfig:
        """Apply ``key=value`` strings with dotted keys (``federation.rounds=2``), over the
        values this config was given (so a preset, even one set here, stays beneath them)."""
        data = override_base(self)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"--set {item!r} must look like key=value")
            key, raw = item.split("=", 1)
            set_dotted(data, key.strip(), yamlio.load(raw) if raw.strip() else None)
        return ExperimentConfig.from_dict(data, source="--set")


def override_base(config: ExperimentConfig) -> dict[str, Any]:
    """What ``--set`` overrides apply to: the mapping ``config`` was read from (before its
    preset was filled in), else (a config built in code) its values that differ from the
    defaults, so that a preset named by an override is not hidden by default values."""
    given = getattr(config, "_given", None)
    if isinstance(given, dict):
        return copy.deepcopy(given)
    return difference(config.to_dict(), ExperimentConfig().to_dict())


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict; the key path is validated later by ``from_dict``."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def _build(cls: type[C], data: Mapping[str, Any], *, prefix: str, source: str) -> C:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(
                f"unknown config key {prefix + str(key)!r}{nearest(str(key), list(fields))}; "
                f"valid keys here: {', '.join(fields)}"
            )
        kwargs[key] = _coerce(hints[key], value, prefix + key, source)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - defensive
        raise ConfigError(f"{prefix.rstrip('.')}: {exc}") from None


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, prefix=key + ".", source=source)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, Mapping):  # a name or a mapping (data.allocation)
            args = [a for a in args if a is dict or typing.get_origin(a) is dict] or args
        return _coerce(args[0], value, key, source)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            value = [value]
        return tuple(value)
    if origin is dict or tp is dict:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value
