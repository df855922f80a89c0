"""``backbone.options``: backbone settings recorded in the config instead of environment
variables (which stay as a fallback); the config wins; unknown options fail early; the feature
cache still tells every frozen setting apart."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from protofl.config import BackboneConfig, ConfigError, ExperimentConfig
from protofl.data.cache import protofl_home
from protofl.engine.runner import run_experiment
from protofl.models import backbones
from protofl.models.backbones import backbone_class, create_backbone

FAST = ["pixels", "random_cnn", "colour_hist", "grad_hist"]
ENV_VARS = (
    "PROTOFL_VIT_CHECKPOINT",
    "PROTOFL_VIT_ADAPT_LAST_K",
    "PROTOFL_VIT_ADAPTER_DIM",
    "PROTOFL_TEXT_ENCODER",
    "PROTOFL_TEXT_POOLING",
    "PROTOFL_TEXT_MAX_LENGTH",
    "PROTOFL_HTFE4_MEMBERS",
    "PROTOFL_HTC4_BASE",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(backbones, "_ENV_NOTED", set())  # each test sees its own INFO lines


def _toy(backbone: str, options: dict[str, Any] | None = None, **extra: Any) -> ExperimentConfig:
    data: dict[str, Any] = {
        "name": f"options-{backbone}",
        "data": {"name": "toy", "train_fraction": 1.0, "max_train_per_domain": 40},
        "backbone": {"name": backbone, "image_size": 16, "proto_dim": 16},
        "federation": {"rounds": 2, "checkpoint": False},
        "method": {"name": "fedproto"},
        "run": {"progress": False, "save_releases": False},
    }
    if options is not None:
        data["backbone"]["options"] = options
    data["backbone"].update(extra)
    return ExperimentConfig.from_dict(data)


def _run(config: ExperimentConfig, out: Path) -> Any:
    return run_experiment(config, out=out)


def test_vit_runs_repeat_exactly_and_reuse_the_feature_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapters' dropout is seeded per (seed, client, round) by the engine, whatever the
    global generator holds; the [N, tokens, d] prefix is read back from the cache."""
    from protofl.models.transformers_backbones import ViTBackbone

    cfg = _toy("vit_random_micro", {"adapt_last_k": 1})
    torch.manual_seed(123)
    first = _run(cfg, tmp_path / "a")

    def no_encoding(self: object, images: object) -> None:
        raise AssertionError("the cached ViT prefix was recomputed")

    monkeypatch.setattr(ViTBackbone, "encode", no_encoding)
    torch.manual_seed(456)  # another global state: the run must not depend on it
    second = _run(cfg, tmp_path / "b")
    assert [h.train_loss for h in second.history] == [h.train_loss for h in first.history]
    assert second.summary["client_acc"] == first.summary["client_acc"]
    # local training draws from a fork: the global generator is left as it was
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation

    sim = Simulation(cfg, build_federated_data(cfg, protofl_home()))
    before = torch.random.get_rng_state()
    sim.train_client(sim.clients[0])
    assert torch.equal(torch.random.get_rng_state(), before)


def _feature_dirs(home: Path) -> list[str]:
    root = home / "features"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _needs(backbone: str) -> None:
    if backbone.startswith(("vit", "text", "minilm")):
        pytest.importorskip("transformers")


# --------------------------------------------------------------------- option == environment

CASES = [
    # backbone, options, the same settings as environment variables, a fragment of the cache key
    (
        "vit_random_micro",
        {"adapt_last_k": 1, "adapter_dim": 6},
        {"PROTOFL_VIT_ADAPT_LAST_K": "1", "PROTOFL_VIT_ADAPTER_DIM": "6"},
        "prefix1of2",
    ),
    ("htfe4", {"members": FAST}, {"PROTOFL_HTFE4_MEMBERS": ",".join(FAST)}, "+".join(FAST)),
    ("htc4", {"base": "pixels"}, {"PROTOFL_HTC4_BASE": "pixels"}, "pixels-seed1234-16px"),
]


@pytest.mark.parametrize(("backbone", "options", "env", "key_part"), CASES)
def test_an_option_in_the_config_gives_exactly_what_the_environment_gives(
    backbone: str,
    options: dict[str, Any],
    env: dict[str, str],
    key_part: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    _isolated_home: Path,
) -> None:
    _needs(backbone)
    by_option = _run(_toy(backbone, options), tmp_path / "option")
    assert _feature_dirs(_isolated_home) and all(
        key_part in d for d in _feature_dirs(_isolated_home)
    )
    # the run folder's config.yaml records the options, and reads back to the same config
    written = yaml.safe_load((by_option.run_dir / "config.yaml").read_text())
    assert written["backbone"]["options"] == options
    assert ExperimentConfig.from_yaml(by_option.run_dir / "config.yaml") == _toy(backbone, options)

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    by_env = _run(_toy(backbone), tmp_path / "env")
    assert yaml.safe_load((by_env.run_dir / "config.yaml").read_text())["backbone"]["options"] == {}
    assert len(_feature_dirs(_isolated_home)) == 1  # the same frozen features: one cache entry
    for key in ("final_train_loss", "acc", "avg_acc"):
        assert by_env.summary[key] == by_option.summary[key], key
    assert by_env.history[-1].train_loss == by_option.history[-1].train_loss


def test_client_models_follow_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    cfg = BackboneConfig(name="vit_random_micro", image_size=16, proto_dim=8, options={})
    opt = BackboneConfig(
        name="vit_random_micro",
        image_size=16,
        proto_dim=8,
        options={"adapt_last_k": 1, "adapter_dim": 6},
    )
    cls = backbone_class(opt)
    bb = cls(16)
    model: Any = cls.client_model(bb.feature_dim, 3, opt, torch.Generator().manual_seed(0))
    assert len(model.adapters) == 1 and model.adapters[0].down.weight.shape == (6, 32)
    plain: Any = backbone_class(cfg).client_model(
        bb.feature_dim, 3, cfg, torch.Generator().manual_seed(0)
    )
    assert len(plain.adapters) == 2 and plain.adapters[0].down.weight.shape == (4, 32)
    monkeypatch.setenv("PROTOFL_VIT_ADAPT_LAST_K", "1")
    monkeypatch.setenv("PROTOFL_VIT_ADAPTER_DIM", "6")
    from_env: Any = backbone_class(cfg).client_model(
        bb.feature_dim, 3, cfg, torch.Generator().manual_seed(0)
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, from_env.state_dict()[k])


# ------------------------------------------------------------------------- precedence, logging


def test_the_config_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PROTOFL_HTFE4_MEMBERS", "pixels,grad_hist")
    monkeypatch.setenv("PROTOFL_HTC4_BASE", "efficientnet_lite0")
    monkeypatch.setenv("PROTOFL_TEXT_POOLING", "cls")
    monkeypatch.setenv("PROTOFL_TEXT_ENCODER", "/env/folder")

    def cls_for(name: str, **options: Any) -> Any:
        return backbone_class(BackboneConfig(name=name, options=options))

    with caplog.at_level(logging.INFO, logger="protofl.models.backbones"):
        assert cls_for("htfe4", members=FAST).member_list() == tuple(FAST)
        assert cls_for("htfe4_fast", members="pixels,colour_hist").member_list() == (
            "pixels",
            "colour_hist",
        )
        assert cls_for("htc4", base="pixels").base_name() == "pixels"
        text = cls_for("text_encoder", pooling="mean", path="/config/folder")
        assert text.setting("pooling") == "mean" and text.setting("path") == "/config/folder"
    assert "environment variable" not in caplog.text  # nothing came from the environment

    with caplog.at_level(logging.INFO, logger="protofl.models.backbones"):
        assert cls_for("htfe4").member_list() == ("pixels", "grad_hist")  # the fallback
        assert cls_for("htfe4").member_list() == ("pixels", "grad_hist")
        assert cls_for("htc4").base_name() == "efficientnet_lite0"
        assert cls_for("text_encoder").setting("pooling") == "cls"
    lines = [r.getMessage() for r in caplog.records if "environment variable" in r.getMessage()]
    assert len(lines) == 3  # one INFO line per variable, however often it is read
    assert any("PROTOFL_HTFE4_MEMBERS" in m and "backbone.options.members" in m for m in lines), (
        lines
    )
    assert any("PROTOFL_HTC4_BASE" in m and "backbone.options.base" in m for m in lines)
    assert any("PROTOFL_TEXT_POOLING" in m and "backbone.options.pooling" in m for m in lines)

    monkeypatch.delenv("PROTOFL_HTFE4_MEMBERS")
    assert cls_for("htfe4").member_list() == (  # neither: the class default
        "effnet_final",
        "effnet_mid",
        "random_cnn",
        "pixels",
    )


def test_the_config_wins_over_the_environment_for_vit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("PROTOFL_VIT_ADAPT_LAST_K", "1")
    monkeypatch.setenv("PROTOFL_VIT_ADAPTER_DIM", "6")
    with caplog.at_level(logging.INFO, logger="protofl.models.backbones"):
        env = create_backbone("vit_random_micro", 16)
        create_backbone("vit_random_micro", 16)
    assert (env.prefix_depth, env.r) == (1, 6)  # type: ignore[attr-defined]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("PROTOFL_VIT_ADAPT_LAST_K" in m for m in lines) == 1
    assert any("backbone.options.adapt_last_k" in m for m in lines)
    # null means "every block" and is recorded, so it too wins over the environment
    cfg = BackboneConfig(
        name="vit_random_micro", image_size=16, options={"adapt_last_k": None, "adapter_dim": 3}
    )
    bb = backbone_class(cfg)(16)
    assert (bb.prefix_depth, bb.r) == (0, 3)  # type: ignore[attr-defined]
    assert bb.cache_key != env.cache_key
    # settings fixed in code win as well
    from protofl.models.transformers_backbones import VitRandomMicro

    assert VitRandomMicro.configured(adapt_last_k=2)(16).prefix_depth == 0


# ------------------------------------------------------------------------------- validation


def test_an_unknown_option_fails_naming_it_and_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        ExperimentConfig().with_overrides(
            ["backbone.name=vit_random_micro", "backbone.options.adapt_last=1"]
        )
    msg = str(err.value)
    assert "backbone.options.adapt_last" in msg and "'vit_random_micro'" in msg
    assert "did you mean 'adapt_last_k'" in msg and "adapt_last_k, adapter_dim" in msg

    with pytest.raises(ConfigError, match=r"backbone\.options\.members.*'pixels' takes no options"):
        ExperimentConfig().with_overrides(["backbone.name=pixels", "backbone.options.members=a"])
    with pytest.raises(ConfigError, match=r"backbone\.options\.adapt_last_k=0 .*integer >= 1"):
        ExperimentConfig().with_overrides(
            ["backbone.name=vit_random_micro", "backbone.options.adapt_last_k=0"]
        )
    with pytest.raises(ConfigError, match=r"backbone\.options\.members.*'nope'"):
        _toy("htfe4", {"members": ["pixels", "nope"]})
    with pytest.raises(ConfigError, match=r"backbone\.options\.base.*did you mean 'pixels'"):
        _toy("htc4", {"base": "pixel"})
    with pytest.raises(ConfigError, match=r"backbone\.options\.base.*cannot itself be htc4"):
        _toy("htc4", {"base": "htc4"})
    with pytest.raises(ConfigError, match=r"backbone\.options\.pooling.*mean, cls"):
        _toy("text_encoder", {"pooling": "max"})
    with pytest.raises(ConfigError, match=r"backbone\.options\.path.*'minilm'"):
        _toy("minilm", {"path": "/x"})  # minilm's weights ship in a package
    with pytest.raises(ConfigError, match=r"backbone\.options must be a mapping"):
        ExperimentConfig().with_overrides(["backbone.options=3"])
    with pytest.raises(ConfigError, match=r"backbone\.options\.x"):
        create_backbone("pixels", 16, {"x": 1})

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"backbone": {"name": "htfe4", "options": {"member": FAST}}}))
    with pytest.raises(ConfigError, match=r"bad\.yaml.*backbone\.options\.member.*'members'"):
        ExperimentConfig.from_yaml(path)


def test_a_bad_option_fails_before_any_data_or_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.engine import federated_data
    from protofl.methods.checks import tiny_config
    from protofl.sweeps import load_sweep

    base = tiny_config("fedproto", "none", rounds=1).to_dict()
    base["backbone"]["name"] = "htfe4_fast"
    sweep = tmp_path / "sweep.yaml"
    grid = {"backbone.options.members": [FAST, "pixels,nope"]}
    sweep.write_text(yaml.safe_dump({"name": "t", "base": base, "grid": grid}))
    with pytest.raises(ConfigError, match=r"grid point 1 .*backbone\.options\.members.*nope"):
        load_sweep(sweep)
    grid = {"seed": [0, 1], "backbone.options.membrs": [FAST]}
    sweep.write_text(yaml.safe_dump({"name": "t", "base": base, "grid": grid}))
    with pytest.raises(ConfigError, match=r"backbone\.options\.membrs.*did you mean 'members'"):
        load_sweep(sweep)

    def no_data(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("data loaded before the backbone was checked")

    monkeypatch.setattr(federated_data, "load_dataset", no_data)
    with pytest.raises(ValueError, match="unknown backbone 'nope'"):
        federated_data.build_federated_data(_toy("nope"), tmp_path)


# ----------------------------------------------------------------------------- feature cache


def test_a_different_option_value_gives_a_different_cache_file(_isolated_home: Path) -> None:
    pytest.importorskip("transformers")
    from protofl.engine.federated_data import build_federated_data

    def prepare(backbone: str, options: dict[str, Any]) -> set[str]:
        before = set(_feature_dirs(_isolated_home))
        build_federated_data(_toy(backbone, options), _isolated_home)
        return set(_feature_dirs(_isolated_home)) - before

    last1 = prepare("vit_random_micro", {"adapt_last_k": 1})
    every = prepare("vit_random_micro", {})
    assert len(last1) == len(every) == 1 and last1 != every
    assert "prefix1of2" in next(iter(last1)) and "prefix0of2" in next(iter(every))
    # an explicit value equal to the default is the same frozen computation: the same cache
    assert prepare("vit_random_micro", {"adapt_last_k": 2}) == set()
    # adapter_dim is trained, not frozen: it shares the cache
    assert prepare("vit_random_micro", {"adapt_last_k": 1, "adapter_dim": 5}) == set()
    two = prepare("htfe4_fast", {"members": ["pixels", "grad_hist"]})
    assert len(two) == 1 and "pixels+grad_hist" in next(iter(two))
    assert len(prepare("htfe4_fast", {})) == 1
    # htc4 shares its base's cache: the base option picks which one
    assert prepare("htc4", {"base": "htfe4_fast"}) == set()


# ----------------------------------------------------------------------------- text encoders
from tests.models.test_transformers_backbones import _tiny_bert  # noqa: E402


def test_text_encoder_options_match_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    folder = str(_tiny_bert(tmp_path / "bert"))
    texts = np.empty(2, dtype=object)
    texts[:] = ["a short one", "a somewhat longer sentence here"]
    opt = create_backbone("text_encoder", 16, {"path": folder, "pooling": "cls", "max_length": 8})
    monkeypatch.setenv("PROTOFL_TEXT_ENCODER", folder)
    monkeypatch.setenv("PROTOFL_TEXT_POOLING", "cls")
    monkeypatch.setenv("PROTOFL_TEXT_MAX_LENGTH", "8")
    env = create_backbone("text_encoder", 16)
    assert opt.cache_key == env.cache_key and "len8-cls" in opt.cache_key
    assert torch.equal(opt.encode(texts), env.encode(texts))
    mean = create_backbone("text_encoder", 16, {"pooling": "mean"})  # the config wins
    assert mean.cache_key != env.cache_key and "-mean" in mean.cache_key
    with pytest.raises(FileNotFoundError, match=r"backbone\.options\.path"):
        create_backbone("text_encoder", 16, {"path": str(tmp_path / "missing")})
