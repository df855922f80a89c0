"""Heterogeneous model families (VPDR Appendix E.4), built from the backbones available offline.

``htfe4``: four *different* frozen feature extractors. They are computed once and cached as ONE
concatenated representation ``[N, d_1 + ... + d_4]``; client ``i`` uses member ``i % 4``: its own
slice, RMS-normalised per sample (the members' scales differ by orders of magnitude), then its
own adapter and a projection to the common prototype dimension, then the head. Prototype methods
see one ``proto_dim``-wide space, as in HtFE.

``htc4``: one extractor (the base backbone, ``efficientnet_lite0`` by default) and classifier
heads of increasing depth: client ``i`` has ``i % 4 + 1`` linear layers after the feature ``f``
(hidden width ``proto_dim``, ReLU between). It shares the base backbone's feature cache.

Models differ between clients, so weight-averaging methods (FedAvg, MOON, ...) do not apply;
prototype methods do.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.config import BackboneConfig
from protofl.models.backbones import (
    BACKBONE_REGISTRY,
    BackboneOption,
    EfficientNetLite0,
    FrozenBackbone,
    PixelProjection,
    create_backbone,
    option_text,
)
from protofl.models.client import ClientModel, init_parameters

ENV_HTFE4_MEMBERS = "PROTOFL_HTFE4_MEMBERS"
ENV_HTC4_BASE = "PROTOFL_HTC4_BASE"

EFFNET_MID_BLOCK = 10  # output of the 11th MBConv block: 112 channels at stride 16


# ---------------------------------------------------------------------------------- members


class Member(ABC):
    """One frozen feature extractor of a heterogeneous family."""

    name: ClassVar[str] = "member"
    dim: ClassVar[int] = 0

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    def weights_id(self) -> str:
        """Fingerprint of the member's frozen weights."""
        return "none"

    @abstractmethod
    def encode(self, images: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """[B, 3, S, S] in [0, 1] -> [B, dim]; ``shared`` memoises work between members."""


class _EffNetTaps:
    """One EfficientNet-Lite0 pass giving the pooled final map and a pooled mid-level map."""

    def __init__(self, image_size: int) -> None:
        self.backbone = EfficientNetLite0(image_size)

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        net: Any = self.backbone.net
        x = ((images - 0.5) / 0.5).contiguous(memory_format=torch.channels_last)
        x = net._swish(net._bn0(net._conv_stem(x)))
        mid = None
        for idx, block in enumerate(net._blocks):
            x = block(x, drop_connect_rate=0.0)
            if idx == EFFNET_MID_BLOCK:
                mid = x.mean(dim=(2, 3))
        x = net._swish(net._bn1(net._conv_head(x)))
        assert mid is not None
        return x.mean(dim=(2, 3)), mid


_EFFNET: dict[int, _EffNetTaps] = {}


def _effnet(image_size: int) -> _EffNetTaps:
    if image_size not in _EFFNET:
        _EFFNET.clear()
        _EFFNET[image_size] = _EffNetTaps(image_size)
    return _EFFNET[image_size]


class EffNetFinal(Member):
    """EfficientNet-Lite0 (ImageNet weights), pooled last map: 1280-d, high-level."""

    name = "effnet_final"
    dim = 1280
    tap: ClassVar[int] = 0  # which output of the shared pass: 0 final map, 1 mid-level map

    def weights_id(self) -> str:
        """The weight file's fingerprint."""
        return _effnet(self.image_size).backbone.weights_id()

    def encode(self, images: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """Pooled feature map ``tap`` of one shared EfficientNet pass (final or mid-level)."""
        if "effnet" not in shared:
            shared["effnet"] = _effnet(self.image_size)(images)
        out: torch.Tensor = shared["effnet"][self.tap]
        return out


class EffNetMid(EffNetFinal):
    """EfficientNet-Lite0, pooled output of block 11 of 16: 112-d, mid-level."""

    name = "effnet_mid"
    dim = 112
    tap = 1


class RandomCNN(Member):
    """A seeded, never-trained 3-layer CNN (32-64-128 channels); avg- and max-pooled: 256-d."""

    name = "random_cnn"
    dim = 256
    seed: ClassVar[int] = 4321

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        g = torch.Generator().manual_seed(self.seed)
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        for mod in self.net:
            if isinstance(mod, nn.Conv2d):
                nn.init.kaiming_normal_(mod.weight, nonlinearity="relu", generator=g)
                nn.init.zeros_(mod.bias)  # type: ignore[arg-type]
        self.net.eval()
        for p in self.net.parameters():
            p.requires_grad_(False)

    def weights_id(self) -> str:
        """Seeded, so constant."""
        return f"seed{self.seed}"

    def encode(self, images: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """Average- and max-pooled last map."""
        fmap = self.net((images - 0.5) / 0.25)
        return torch.cat([fmap.mean(dim=(2, 3)), fmap.amax(dim=(2, 3))], dim=1)


class Pixels(Member):
    """The ``pixels`` backbone: a fixed random projection of grey pixels, 256-d."""

    name = "pixels"
    dim = 256

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        self.inner = PixelProjection(image_size)

    def weights_id(self) -> str:
        """Seeded, so constant."""
        return self.inner.weights_id()

    def encode(self, images: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """Projected grey pixels."""
        return self.inner.encode_batch(images)


class ColourHist(Member):
    """Colour statistics: 16-bin histogram per channel, plus per-channel mean and std on a 2x2
    grid: 72-d."""

    name = "colour_hist"
    dim = 72
    bins: ClassVar[int] = 16

    def encode(self, images: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """Histograms (fractions) and grid moments."""
        b, c, h, w = images.shape
        idx = (images.clamp(0, 1) * (self.bins - 1e-4)).long().flatten(2)  # [B, 3, HW]
        ones = torch.ones_like(idx, dtype=images.dtype)
        hist = torch.zeros(b, c, self.bins).scatter_add_(2, idx, ones)
        hist = hist / (h * w)
        grid = F.adaptive_avg_pool2d(images, 2).flatten(1)  # [B, 12]
        sq = F.adaptive_avg_pool2d(images * images, 2).flatten(1)
        std = (sq - grid * grid).clamp(min=0).sqrt()
        return torch.cat([hist.flatten(1), grid, std], dim=1)


class GradHist(Member):
    """HOG-like: unsigned gradient orientations (8 bins) weighted by magnitude on a 4x4 grid,
    L2-normalised per cell: 128-d."""

    name = "grad_hist"
    dim = 128
    bins: ClassVar[int] = 8
    grid: ClassVar[int] = 4

    def encode(self, images: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """Orientation histograms per cell."""
        grey = images.mean(dim=1, keepdim=True)
        kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]).view(1, 1, 3, 3)
        gx = F.conv2d(F.pad(grey, (1, 1, 1, 1), mode="replicate"), kx)
        gy = F.conv2d(F.pad(grey, (1, 1, 1, 1), mode="replicate"), kx.transpose(2, 3))
        mag = torch.sqrt(gx * gx + gy * gy)
        ang = torch.remainder(torch.atan2(gy, gx), math.pi)  # [0, pi)
        which = (ang / math.pi * self.bins).long().clamp(max=self.bins - 1)
        onehot = F.one_hot(which.squeeze(1), self.bins).permute(0, 3, 1, 2).to(images.dtype)
        cells = F.adaptive_avg_pool2d(onehot * mag, self.grid)  # [B, bins, g, g]
        cells = cells / (cells.norm(dim=1, keepdim=True) + 1e-6)
        return cells.permute(0, 2, 3, 1).flatten(1)


MEMBERS: dict[str, type[Member]] = {
    m.name: m for m in (EffNetFinal, EffNetMid, RandomCNN, Pixels, ColourHist, GradHist)
}


def parse_members(value: Any) -> tuple[str, ...]:
    """Member names, in order, from a list or a comma-separated string; all must be known."""
    if isinstance(value, str):
        names = tuple(n.strip() for n in value.split(",") if n.strip())
    elif isinstance(value, list | tuple) and all(isinstance(n, str) for n in value):
        names = tuple(n.strip() for n in value)
    else:
        raise ValueError("expected a list of member names (or 'a,b,c')")
    if not names:
        raise ValueError("names no member; choose from " + ", ".join(MEMBERS))
    unknown = [n for n in names if n not in MEMBERS]
    if unknown:
        raise ValueError(f"unknown member(s) {unknown}; choose from " + ", ".join(MEMBERS))
    return names


def parse_base(value: Any) -> str:
    """A registered backbone that is not itself an ``htc4``."""
    name = option_text(value)
    if issubclass(BACKBONE_REGISTRY.get(name), HtC4):
        raise ValueError("the base cannot itself be htc4")
    return name


HTFE_OPTIONS: dict[str, BackboneOption] = {
    "members": BackboneOption(
        "the extractors, in order (a list or 'a,b,c'); client i uses member i % M",
        ENV_HTFE4_MEMBERS,
        parse_members,
    )
}
HTC4_OPTIONS: dict[str, BackboneOption] = {
    "base": BackboneOption(
        "the base backbone (any registered one but htc4); its cache is shared",
        ENV_HTC4_BASE,
        parse_base,
    )
}


# ------------------------------------------------------------------------------ client models


def rms_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale each row to unit root-mean-square (parameter-free)."""
    return x / x.pow(2).mean(dim=1, keepdim=True).add(eps).sqrt()


class SliceClientModel(ClientModel):
    """The default client model (adapter, projection, head) on one member's slice of ``z``."""

    def __init__(
        self, start: int, stop: int, member: str, num_classes: int, config: BackboneConfig
    ) -> None:
        super().__init__(stop - start, num_classes, config)
        self.start, self.stop, self.member = start, stop, member

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """``proj(adapter(rms(z[:, start:stop])))``."""
        return super().features(rms_normalise(z[:, self.start : self.stop]))


def deep_head(width: int, num_classes: int, depth: int) -> nn.Module:
    """``depth`` linear layers (hidden width ``width``, ReLU between); depth 1 is linear."""
    if depth == 1:
        return nn.Linear(width, num_classes)
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------- backbones


class HtFEBackbone(FrozenBackbone):
    """Several frozen extractors cached as one concatenation; client i uses member i % M."""

    name = "htfe"
    members: ClassVar[tuple[str, ...]] = ("effnet_final", "effnet_mid", "random_cnn", "pixels")
    accepted_options = HTFE_OPTIONS

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        self.member_names = self.member_list()
        self.parts = [MEMBERS[n](image_size) for n in self.member_names]
        self.feature_dim = sum(p.dim for p in self.parts)

    @classmethod
    def member_list(cls) -> tuple[str, ...]:
        """The members (``backbone.options.members``, else the environment, else the class)."""
        return parse_members(cls.setting("members"))

    @classmethod
    def slices(cls) -> list[tuple[str, int, int]]:
        """(member, start, stop) of each member in the cached representation."""
        out, start = [], 0
        for name in cls.member_list():
            out.append((name, start, start + MEMBERS[name].dim))
            start += MEMBERS[name].dim
        return out

    @property
    def cache_key(self) -> str:
        """Name, members (in order), weights and input size."""
        return f"{self.name}-{'+'.join(self.member_names)}-{self.weights_id()}-{self.image_size}px"

    def weights_id(self) -> str:
        """Fingerprint over the members' fingerprints."""
        import hashlib

        joined = "|".join(f"{p.name}:{p.weights_id()}" for p in self.parts)
        return hashlib.sha256(joined.encode()).hexdigest()[:12]

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Every member on the same batch, concatenated in member order."""
        shared: dict[str, Any] = {}
        return torch.cat([p.encode(images, shared).float() for p in self.parts], dim=1)

    @classmethod
    def client_model(
        cls,
        in_dim: int,
        num_classes: int,
        config: BackboneConfig,
        generator: torch.Generator,
        client: int = 0,
    ) -> nn.Module:
        """Member ``client % M``: its slice, adapter, projection to ``proto_dim``, head."""
        slices = cls.slices()
        if in_dim != slices[-1][2]:
            raise ValueError(
                f"{cls.name}: cached width {in_dim} does not match the members "
                f"{[s[0] for s in slices]} (width {slices[-1][2]})"
            )
        member, start, stop = slices[client % len(slices)]
        model = SliceClientModel(start, stop, member, num_classes, config)
        init_parameters(model, generator)
        return model


@BACKBONE_REGISTRY.register("htfe4")
class HtFE4(HtFEBackbone):
    """HtFE4: EfficientNet-Lite0 final and mid-level features, a random CNN, random pixel
    projection (other members: ``backbone.options.members``, or PROTOFL_HTFE4_MEMBERS)."""

    name = "htfe4"


@BACKBONE_REGISTRY.register("htfe4_fast")
class HtFE4Fast(HtFEBackbone):
    """HtFE4 without pretrained weights (pixels, random CNN, colour and gradient histograms):
    fast, for tests and smoke runs."""

    name = "htfe4_fast"
    members = ("pixels", "random_cnn", "colour_hist", "grad_hist")


@BACKBONE_REGISTRY.register("htc4")
class HtC4(FrozenBackbone):
    """HtC4: one base backbone (``backbone.options.base``, else ``PROTOFL_HTC4_BASE``, default
    ``efficientnet_lite0``) and heads of 1..4 layers (client ``i`` gets ``i % 4 + 1``)."""

    name = "htc4"
    base: ClassVar[str] = "efficientnet_lite0"
    depths: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)
    accepted_options = HTC4_OPTIONS

    @classmethod
    def base_name(cls) -> str:
        """The base backbone's registry name."""
        name = str(cls.setting("base"))
        if name == cls.name or issubclass(BACKBONE_REGISTRY.get(name), HtC4):
            raise ValueError(f"{cls.name}: base={name!r}: the base cannot itself be htc4")
        return name

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        self.inner = create_backbone(self.base_name(), image_size)
        self.feature_dim = self.inner.feature_dim

    @property
    def cache_key(self) -> str:
        """The base backbone's: the frozen computation is the same, so is the cache."""
        return self.inner.cache_key

    def weights_id(self) -> str:
        """The base backbone's."""
        return self.inner.weights_id()

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        """The base backbone's."""
        return self.inner.preprocess(images)

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """The base backbone's."""
        return self.inner.encode_batch(images)

    def encode(
        self,
        images: np.ndarray,
        *,
        batch_size: int = 256,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The base backbone's (text backbones included)."""
        return self.inner.encode(images, batch_size=batch_size, device=device)

    @classmethod
    def client_model(
        cls,
        in_dim: int,
        num_classes: int,
        config: BackboneConfig,
        generator: torch.Generator,
        client: int = 0,
    ) -> nn.Module:
        """The base's client model with its head replaced by one of depth ``client % 4 + 1``."""
        base = BACKBONE_REGISTRY.get(cls.base_name())
        model = base.client_model(in_dim, num_classes, config, generator, client=client)
        depth = cls.depths[client % len(cls.depths)]
        head = deep_head(config.proto_dim, num_classes, depth)
        init_parameters(head, generator)
        model.head = head
        return model
