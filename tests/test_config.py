from __future__ import annotations

from pathlib import Path

import pytest

from protofl.config import ConfigError, ExperimentConfig


def test_defaults_are_the_embedded_experiment() -> None:
    cfg = ExperimentConfig()
    assert cfg.method.name == "fedproto"
    assert cfg.data.name == "digits4"
    assert cfg.federation.lr == 1e-3 and cfg.federation.weight_decay == 1e-5


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = ExperimentConfig().with_overrides(["federation.rounds=3", "method.params.lam=0.5"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    again = ExperimentConfig.from_yaml(path)
    assert again == cfg
    assert again.federation.rounds == 3
    assert again.method.params == {"lam": 0.5}


def test_dotted_overrides_coerce_types() -> None:
    cfg = ExperimentConfig().with_overrides(
        ["seed=1", "data.train_fraction=1", "data.domains=[mnist, optdigits]", "privacy.dcr=true"]
    )
    assert cfg.seed == 1
    assert cfg.data.train_fraction == 1.0 and isinstance(cfg.data.train_fraction, float)
    assert cfg.data.domains == ("mnist", "optdigits")
    assert cfg.privacy.dcr is True


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("federation.rounds=0", "federation.rounds"),
        ("data.train_fraction=0", "data.train_fraction"),
        ("data.train_fraction=1.5", "data.train_fraction"),
        ("federation.batch_size=0", "federation.batch_size"),
        ("federation.lr=-1", "federation.lr"),
        ("backbone.head=resnet", "backbone.head"),
    ],
)
def test_out_of_range_values_name_the_parameter(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        ExperimentConfig().with_overrides([override])


def test_unknown_key_names_key_and_nearest() -> None:
    with pytest.raises(ConfigError) as err:
        ExperimentConfig().with_overrides(["federation.round=2"])
    assert "federation.round" in str(err.value)
    assert "rounds" in str(err.value)
    with pytest.raises(ConfigError, match="unknown config key 'dta'"):
        ExperimentConfig.from_dict({"dta": {}})


def test_wrong_type_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"federation\.rounds must be an integer"):
        ExperimentConfig().with_overrides(["federation.rounds=two"])


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("federation:\n  rouds: 3\n")
    with pytest.raises(ConfigError, match=str(bad)):
        ExperimentConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        ExperimentConfig.from_yaml(tmp_path / "missing.yaml")


def test_privacy_vpdr_means_vpp_plus_dcr() -> None:
    cfg = ExperimentConfig().with_overrides(["privacy.mechanism=vpdr"])
    assert cfg.privacy.base_mechanism == "vpp"
    assert cfg.privacy.use_dcr


def test_data_allocation_takes_a_name_or_a_mapping_of_clients_per_domain() -> None:
    given = ExperimentConfig().with_overrides(["data.allocation={mnist: 3, optdigits: 1}"])
    assert given.data.allocation == {"mnist": 3, "optdigits": 1}
    assert ExperimentConfig.from_dict(given.to_dict()).data.allocation == given.data.allocation
    assert ExperimentConfig().with_overrides(["data.allocation=feddap"]).data.allocation == "feddap"


def test_client_state_and_memory_budget_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"run\.client_state"):
        ExperimentConfig().with_overrides(["run.client_state=ssd"])
    with pytest.raises(ConfigError, match=r"run\.memory_budget_mb"):
        ExperimentConfig().with_overrides(["run.memory_budget_mb=0"])
    ok = ExperimentConfig().with_overrides(
        ["run.client_state=disk", "federation.execution=batched", "run.memory_budget_mb=64"]
    )
    assert ok.run.client_state == "disk" and ok.run.memory_budget_mb == 64


def test_numbers_written_without_a_dot_are_numbers(tmp_path: Path) -> None:
    # measured: --set federation.weight_decay=1e-5 and `lr: 1e-3` in a file were refused as
    # "must be a number, got '1e-5'" (PyYAML's YAML 1.1 needs 1.0e-5)
    config = ExperimentConfig().with_overrides(["federation.weight_decay=1e-5"])
    assert config.federation.weight_decay == 1e-5
    path = tmp_path / "exp.yaml"
    path.write_text("federation:\n  lr: 1e-3\n  weight_decay: 2E+0\nname: run-1e3\n")
    from_file = ExperimentConfig.from_yaml(path)
    assert from_file.federation.lr == 1e-3 and from_file.federation.weight_decay == 2.0
    assert from_file.name == "run-1e3"  # not a number: stays a string
    from protofl.sweeps import load_sweep

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: s\ngrid:\n  federation.lr: [1e-3, 1e-2]\n")
    lrs = sorted(p.config.federation.lr for p in load_sweep(sweep).points)
    assert lrs == [1e-3, 1e-2]
