"""CIFAR-style ResNet-10 / ResNet-18 trained from scratch (FedDAP's backbone).

Nothing is frozen here: the "frozen prefix" that the feature cache stores is only the resized,
ImageNet-normalised image ``[N, 3, S, S]``; the client model is the whole ResNet (3x3 stem, no
max-pool, four stages of BasicBlocks with 64/128/256/512 channels), a 512-d feature ``f`` =
global-average-pooled layer4 (projected linearly to ``proto_dim`` when that is not 512) and a
linear head. FedDAP trains at 32 px with random-crop (padding 4) and horizontal-flip
augmentation; the client model applies the same augmentation to the cached tensor in training
mode, from its own seeded generator. BatchNorm running statistics are part of the state dict,
so weight-averaging methods (FedAvg) average them too, as FedDAP does.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from protofl.config import BackboneConfig
from protofl.models.backbones import BACKBONE_REGISTRY, FrozenBackbone
from protofl.models.client import ClientModelBase

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FEATURE_DIM = 512
CROP_PADDING = 4


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a (projected when needed) identity shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut(x))."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """3x3 stem (no max-pool) and four stages; ``forward`` returns the avg-pooled 512-d map."""

    def __init__(self, blocks: tuple[int, int, int, int], width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers: list[nn.Module] = []
        in_planes = width
        for stage, n in enumerate(blocks):
            planes = width * 2**stage
            stride = 1 if stage == 0 else 2
            stage_blocks: list[nn.Module] = []
            for b in range(n):
                stage_blocks.append(BasicBlock(in_planes, planes, stride if b == 0 else 1))
                in_planes = planes
            layers.append(nn.Sequential(*stage_blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.out_dim = in_planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, 512]."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return F.adaptive_avg_pool2d(out, 1).flatten(1)


def init_resnet(module: nn.Module, generator: torch.Generator) -> None:
    """Seeded init: Kaiming-normal (fan_out) convolutions, BN = (1, 0), uniform linears."""
    for mod in module.modules():
        if isinstance(mod, nn.Conv2d):
            nn.init.kaiming_normal_(
                mod.weight, mode="fan_out", nonlinearity="relu", generator=generator
            )
        elif isinstance(mod, nn.BatchNorm2d):
            nn.init.ones_(mod.weight)
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Linear):
            bound = 1.0 / math.sqrt(mod.in_features)
            with torch.no_grad():
                mod.weight.uniform_(-bound, bound, generator=generator)
                if mod.bias is not None:
                    mod.bias.uniform_(-bound, bound, generator=generator)


def random_crop_flip(
    x: torch.Tensor, generator: torch.Generator, pad_value: torch.Tensor, padding: int
) -> torch.Tensor:
    """Per-sample random crop after padding (with ``pad_value`` per channel) and h-flip."""
    b, c, h, w = x.shape
    padded = pad_value.view(1, c, 1, 1).to(x.dtype).expand(b, c, h + 2 * padding, w + 2 * padding)
    padded = padded.clone()
    padded[:, :, padding : padding + h, padding : padding + w] = x
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    rows = oy[:, None] + torch.arange(h)[None, :]  # [B, H]
    cols = ox[:, None] + torch.arange(w)[None, :]  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    # drawn on the CPU generator (the same crops on every device), applied where x lives
    dev = x.device
    rows, cols = rows.to(dev), cols.to(dev)
    bidx = torch.arange(b, device=dev)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[bidx, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    return out.permute(0, 3, 1, 2).contiguous()


class ResNetClientModel(ClientModelBase):
    """The whole trainable ResNet on the cached normalised image: ``(f, logits)``.

    Every parameter is trainable (nothing is frozen).
    """

    def __init__(
        self,
        blocks: tuple[int, int, int, int],
        num_classes: int,
        config: BackboneConfig,
        *,
        augment: bool = True,
    ) -> None:
        super().__init__()
        self.net = CifarResNet(blocks)
        self.proj: nn.Module = (
            nn.Identity()
            if config.proto_dim == self.net.out_dim
            else nn.Linear(self.net.out_dim, config.proto_dim)
        )
        if config.head == "mlp":
            self.head: nn.Module = nn.Sequential(
                nn.Linear(config.proto_dim, config.proto_dim),
                nn.ReLU(),
                nn.Linear(config.proto_dim, num_classes),
            )
        else:
            self.head = nn.Linear(config.proto_dim, num_classes)
        self.augment = augment
        self.aug_generator = torch.Generator().manual_seed(0)
        mean = torch.tensor(IMAGENET_MEAN)
        std = torch.tensor(IMAGENET_STD)
        self.register_buffer("pad_value", (0.0 - mean) / std, persistent=False)  # black pixels

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """Prototype-space feature of cached normalised images (augmented in training mode)."""
        if z.ndim != 4 or z.shape[1] != 3:
            raise ValueError(
                f"ResNet client model expects normalised images [N, 3, S, S], got {tuple(z.shape)}"
            )
        if self.training and self.augment:
            pad = self.get_buffer("pad_value")
            z = random_crop_flip(z, self.aug_generator, pad, CROP_PADDING)
        return self.proj(self.net(z))


class CifarResNetBackbone(FrozenBackbone):
    """Trained from scratch: the cached prefix is the resized, ImageNet-normalised image."""

    name = "resnet"
    feature_dim = 3  # channels of the cached tensor [N, 3, S, S]
    blocks: ClassVar[tuple[int, int, int, int]] = (2, 2, 2, 2)
    augment: ClassVar[bool] = True

    def weights_id(self) -> str:
        """No frozen weights: only the normalisation."""
        return "imagenet-norm"

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """(x - mean) / std with ImageNet statistics (FedDAP's transform)."""
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        return (images - mean) / std

    @classmethod
    def client_model(
        cls,
        in_dim: int,
        num_classes: int,
        config: BackboneConfig,
        generator: torch.Generator,
        client: int = 0,
    ) -> nn.Module:
        """A freshly initialised ResNet; the same generator state gives the same weights."""
        model = ResNetClientModel(cls.blocks, num_classes, config, augment=cls.augment)
        init_resnet(model, generator)
        # Augmentation stream: drawn after the init (so homogeneous clients start identical),
        # mixed with the client index (so clients do not crop identically).
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        model.aug_generator.manual_seed((seed + 1_000_003 * (client + 1)) % 2**63)
        return model


@BACKBONE_REGISTRY.register("resnet10")
class ResNet10(CifarResNetBackbone):
    """CIFAR-style ResNet-10 (one BasicBlock per stage): FedDAP on Office-10 and DomainNet."""

    name = "resnet10"
    blocks = (1, 1, 1, 1)


@BACKBONE_REGISTRY.register("resnet18")
class ResNet18(CifarResNetBackbone):
    """CIFAR-style ResNet-18 (two BasicBlocks per stage): FedDAP on PACS."""

    name = "resnet18"
    blocks = (2, 2, 2, 2)
