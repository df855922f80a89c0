"""Experiment presets (``preset: vpdr | feddap``): the papers' values, beneath the user's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from protofl.cli import main
from protofl.config import ConfigError, DataConfig, ExperimentConfig
from protofl.engine.rundir import RECORD, check_resume, flatten, write_record
from protofl.methods import create_method
from protofl.presets import PRESETS, preset_settings

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"


def resolved(preset: str, *overrides: str) -> dict[str, Any]:
    """The flattened config ``--set preset=... --set ...`` gives."""
    return flatten(ExperimentConfig().with_overrides([f"preset={preset}", *overrides]).to_dict())


def assert_values(got: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    wrong = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    assert not wrong, f"{where}: (resolved, paper) = {wrong}"


# ----------------------------------------------------------------------------------- VPDR
VPDR_PROTOCOL = {
    # VPDR Sec. 5.1, "Implementation Details": T = 20, E = 2, batch 256, AdamW with learning
    # rate 1e-3, weight decay 1e-5 and momentum 0.9
    "federation.rounds": 20,
    "federation.local_epochs": 2,
    "federation.batch_size": 256,
    "federation.optimizer": "adamw",
    "federation.lr": 1e-3,
    "federation.weight_decay": 1e-5,
    "federation.momentum": 0.9,
    # Sec. 5.1, "Model": d = 512, "train only the adapters and the classifier"
    "backbone.proto_dim": 512,
    "backbone.train_projection": False,
    # Sec. 5.1: (eps, delta) = (1, 1e-5); VPDR defaults H = 0.1, r = 0.1, rho = 0.2,
    # gamma = 0.05, beta = 0.999; Sec. 5.3: the KD temperature tau = 4
    "privacy.mechanism": "vpdr",
    "privacy.epsilon": 1.0,
    "privacy.delta": 1e-5,
    "privacy.vpp_score_max": 0.1,
    "privacy.vpp_ratio": 0.1,
    "privacy.vpp_rho": 0.2,
    "privacy.dcr_gamma": 0.05,
    "privacy.dcr_beta": 0.999,
    "privacy.dcr_tau": 4.0,
    # Sec. 5.1: R by grid search over {5, 10, 15, 20}; 5 is the reference code's default
    "privacy.clip": 5.0,
    # the reference code reports the last round
    "run.headline": "final",
}
VPDR_DATA = {
    # Sec. 5.1: four domain-specific clients, 10% of Digits, 30% of Office-Caltech and PACS
    "digits": {"data.allocation": "one_per_domain", "data.train_fraction": 0.1},
    "digits4": {"data.allocation": "one_per_domain", "data.train_fraction": 0.1},
    "office_caltech10": {"data.allocation": "one_per_domain", "data.train_fraction": 0.3},
    "pacs": {"data.allocation": "one_per_domain", "data.train_fraction": 0.3},
    # Table 3: label skew on CIFAR-10 with M = 20 clients and a Dirichlet partition
    "cifar10": {"data.clients_per_domain": 20, "data.partition": "dirichlet"},
}
VPDR_METHODS = {
    # Table 8 (Appendix E.2)
    "fedproto": {"lam": 0.1},  # proximal weight lambda
    "fedpcl": {"tau": 0.07},  # contrastive temperature
    "fpl": {"temperature": 0.07},  # contrastive temperature
    "fedplvm": {"alpha": 0.25, "tau": 0.07, "lam": 0.5},  # alpha-sparsity, tau, proto weight
    "fedtgp": {"lam": 1.0, "server_epochs": 100, "margin_cap": 100.0},  # lambda, rounds, margin
    "mpft": {"temperature": 4.0, "beta": 0.3, "server_lr": 1e-3, "server_epochs": 20},
}


def test_vpdr_preset_is_the_papers_protocol() -> None:
    for dataset, data_values in VPDR_DATA.items():
        got = resolved("vpdr", f"data.name={dataset}")
        assert_values(got, {**VPDR_PROTOCOL, **data_values}, f"vpdr on {dataset}")
        assert got["method.name"] == "fedproto"  # VPDR is a plug-in: the method stays the user's
    for method, params in VPDR_METHODS.items():
        got = resolved("vpdr", f"method.name={method}")
        assert_values(got, {f"method.params.{k}": v for k, v in params.items()}, method)
    # a method Table 8 does not list keeps its own defaults
    assert resolved("vpdr", "method.name=fedavg").get("method.params") == {}


# --------------------------------------------------------------------------------- FedDAP
FEDDAP_PROTOCOL = {
    # FedDAP Sec. 4.1, "Implementation Details": 100 rounds, 10 local epochs, the mean accuracy
    # over the last 5 communication rounds
    "federation.rounds": 100,
    "federation.local_epochs": 10,
    "run.headline": "last5",
    # reference code (the paper gives no optimiser): SGD lr 0.01, momentum 0.9, wd 1e-5
    "federation.optimizer": "sgd",
    "federation.lr": 0.01,
    "federation.momentum": 0.9,
    "federation.weight_decay": 1e-5,
    # the network trains end to end; the main results are without DP (Supp. Table 7)
    "backbone.train_projection": True,
    "privacy.mechanism": "none",
    "method.name": "feddap",
}
FEDDAP_DATA = {
    # Sec. 4.1: PACS 10 clients photo 3, art 2, cartoon 1, sketch 4, each sampling 30%;
    # batch 16 for PACS, 32 for DomainNet and Office-10
    "pacs": {
        "data.allocation": "feddap",
        "data.fraction_unit": "client",
        "data.train_fraction": 0.3,
        "federation.batch_size": 16,
        # ours: the held-out crossval lists (FedDAP's test_kfold holds every training image)
        "data.options.protocol": "official",
    },
    # Office-10: caltech 3, amazon 2, webcam 1, dslr 4, 20%
    "office_caltech10": {
        "data.allocation": "feddap",
        "data.fraction_unit": "client",
        "data.train_fraction": 0.2,
        "federation.batch_size": 32,
    },
    # DomainNet: 20 clients, 10%
    "domainnet": {
        "data.allocation": "feddap",
        "data.fraction_unit": "client",
        "data.train_fraction": 0.1,
        "federation.batch_size": 32,
    },
    # not in the paper: the reference code's Digits (1% per client, batch 32), the paper's equal
    # allocation (Supp. 7.3: 12 clients, 3 per domain)
    "digits": {
        "data.clients_per_domain": 3,
        "data.fraction_unit": "client",
        "data.train_fraction": 0.01,
        "federation.batch_size": 32,
    },
    "digits4": {
        "data.clients_per_domain": 3,
        "data.fraction_unit": "client",
        "data.train_fraction": 0.01,
        "federation.batch_size": 32,
    },
}
FEDDAP_METHODS = {
    # Eq. (10) lambda1, lambda2; Sec. 4.6 tau_agg = 0.001 (DomainNet, PACS)
    "feddap": {"lambda1": 1.0, "lambda2": 1.0, "tau_agg": 0.001},
    # Supp. 6.1 "Details of Baselines"
    "fedprox": {"mu": 0.001},
    "fedproto": {"lam": 1.0},
    "fpl": {"temperature": 0.02},
    "fedplvm": {"tau": 0.07, "alpha": 0.25, "lam": 100.0},
}
# Sec. 4.1 "Baselines": FedProto "(with parameter averaging)", FPL and FedPLVM in their own
# papers' weight-averaged forms (FedDAP compares one global model against global models)
FEDDAP_WEIGHT_AVERAGED = ("fedproto", "fpl", "fedplvm")


def test_feddap_preset_is_the_papers_protocol() -> None:
    for dataset, data_values in FEDDAP_DATA.items():
        got = resolved("feddap", f"data.name={dataset}")
        assert_values(got, {**FEDDAP_PROTOCOL, **data_values}, f"feddap on {dataset}")
    for method, params in FEDDAP_METHODS.items():
        got = resolved("feddap", f"method.name={method}")
        assert_values(got, {f"method.params.{k}": v for k, v in params.items()}, method)
    for method in FEDDAP_WEIGHT_AVERAGED:
        assert resolved("feddap", f"method.name={method}")["method.params.share_weights"] is True
        # under VPDR the same methods are personalised (prototypes only)
        vpdr = ExperimentConfig().with_overrides(["preset=vpdr", f"method.name={method}"])
        assert not create_method(
            method, vpdr.method.params, num_classes=2, num_domains=1, proto_dim=2
        ).shares_weights
    # MOON's mu is tuned in {0.5, 1, 5, 10} (Supp. 6.1); the preset takes a value from that set
    assert resolved("feddap", "method.name=moon")["method.params.mu"] in (0.5, 1.0, 5.0, 10.0)


def test_every_preset_value_is_a_valid_config_and_method_params() -> None:
    from protofl.methods import create_method

    for preset in PRESETS.values():
        for dataset in preset.datasets:
            for method in [*preset.methods, "fedavg"]:
                config = ExperimentConfig().with_overrides(
                    [f"preset={preset.name}", f"data.name={dataset}", f"method.name={method}"]
                )
                create_method(
                    method, config.method.params, num_classes=10, num_domains=4, proto_dim=512
                )


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["preset=vpd"], ["preset='vpd' is unknown", "did you mean 'vpdr'", "vpdr, feddap"]),
        (["preset=7"], ["preset=7 is unknown", "valid presets: vpdr, feddap"]),
        (
            ["preset=feddap", "data.name=cifar10"],
            ["preset 'feddap' has no values for data set 'cifar10'", "digits4", "pacs"],
        ),
        (
            ["preset=vpdr", "data.name=domainnet"],
            ["preset 'vpdr' has no values for data set 'domainnet'", "office_caltech10"],
        ),
    ],
)
def test_bad_presets_fail_in_one_line_naming_the_valid_ones(
    overrides: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        ExperimentConfig().with_overrides(overrides)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message
    # the same through the command line: one line, exit code 2, no traceback
    assert main(["config", *[a for o in overrides for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needles[0] in err and "Traceback" not in err


def test_bad_preset_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("preset: fed_dap\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: preset='fed_dap' is unknown")):
        ExperimentConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="has no values for data set 'vlcs'"):
        ExperimentConfig(preset="vpdr", data=DataConfig(name="vlcs"))


# --------------------------------------------------------------------------- override wins
def test_the_users_values_win_over_the_preset_and_are_recorded(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "preset": "feddap",
                "data": {"name": "pacs", "options": {"protocol": "feddap"}},
                # equal to the project default, but written: it wins over FedDAP's 100
                "federation": {"rounds": 20, "optimizer": "adamw"},
                "method": {"params": {"tau_cross": 0.04}},
            }
        )
    )
    config = ExperimentConfig.from_yaml(path).with_overrides(["federation.lr=0.05"])
    assert config.federation.rounds == 20 and config.federation.optimizer == "adamw"
    assert config.federation.lr == 0.05  # --set wins over the preset
    assert config.federation.local_epochs == 10  # what the user left alone is the preset's
    # FedDAP's own split is a named option, kept when asked for
    assert config.data.options == {"protocol": "feddap"}
    # method params merge key by key: the user's tau_cross, the preset's others
    assert config.method.params["tau_cross"] == 0.04 and config.method.params["lambda1"] == 1.0
    written = yaml.safe_load(config.to_yaml())
    assert written["preset"] == "feddap" and written["federation"]["rounds"] == 20
    assert (
        written["federation"]["lr"] == 0.05 and written["data"]["options"]["protocol"] == "feddap"
    )
    # --set beats the file, and the file beats the preset
    again = ExperimentConfig.from_yaml(path).with_overrides(["federation.rounds=7"])
    assert again.federation.rounds == 7


def test_a_preset_set_by_override_sits_beneath_the_file(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("federation:\n  rounds: 20\nmethod:\n  name: fpl\n")
    config = ExperimentConfig.from_yaml(path).with_overrides(["preset=feddap"])
    assert config.federation.rounds == 20  # the file's value, though it equals the default
    assert config.federation.local_epochs == 10 and config.method.name == "fpl"
    assert config.method.params["temperature"] == 0.02  # FedDAP's FPL entry, not VPDR's
    # switching the method picks that method's entry (no parameter of the old one stays)
    moon = config.with_overrides(["method.name=moon"])
    assert moon.method.params == {"mu": 5.0, "temperature": 0.5}
    # a null value takes a preset's value away; a null section keeps them
    no_alloc = config.with_overrides(["data.name=pacs", "data.allocation=", "data.options="])
    assert no_alloc.data.allocation is None and no_alloc.data.options == {"protocol": "official"}


def test_a_different_data_set_or_preset_takes_its_own_values() -> None:
    pacs = ExperimentConfig().with_overrides(["preset=feddap", "data.name=pacs"])
    office = pacs.with_overrides(["data.name=office_caltech10"])
    assert pacs.data.train_fraction == 0.3 and office.data.train_fraction == 0.2
    assert office.data.options == {"protocol": "feddap"} and office.federation.batch_size == 32
    vpdr = office.with_overrides(["preset=vpdr", "method.name=fedproto"])
    assert vpdr.data.train_fraction == 0.3 and vpdr.federation.optimizer == "adamw"
    assert vpdr.data.allocation == "one_per_domain" and vpdr.data.fraction_unit == "domain"


def test_a_client_count_override_is_not_lost_under_a_one_per_domain_preset(
    tmp_path: Path,
) -> None:
    # measured: a sweep with preset vpdr and clients_per_domain=5 built 4 clients, not 20 (the
    # preset's one_per_domain allocation silently ignored the user's count)
    vpdr = ExperimentConfig().with_overrides(["preset=vpdr"])
    assert vpdr.data.allocation == "one_per_domain"
    skew = vpdr.with_overrides(["data.clients_per_domain=5", "data.partition=dirichlet"])
    assert skew.data.clients_per_domain == 5 and skew.data.allocation == "equal"
    assert skew.data.train_fraction == 0.1 and skew.federation.local_epochs == 2  # the rest stays
    assert yaml.safe_load(skew.to_yaml())["data"]["allocation"] == "equal"  # recorded
    from protofl.engine.federated_data import client_counts

    domains = ["mnist", "optdigits", "syndigits", "mnistm"]
    assert client_counts(skew, "digits4", domains) == dict.fromkeys(domains, 5)
    # a file's data section behaves the same (the sweep's base)
    path = tmp_path / "exp.yaml"
    path.write_text("preset: vpdr\ndata:\n  clients_per_domain: 3\n")
    assert ExperimentConfig.from_yaml(path).data.allocation == "equal"
    # asking for both at once is a contradiction, refused in one line naming both keys
    with pytest.raises(ConfigError, match=r"data\.clients_per_domain=5 .*data\.allocation="):
        vpdr.with_overrides(["data.allocation=one_per_domain", "data.clients_per_domain=5"])
    with pytest.raises(ConfigError, match=r"data\.allocation='feddap'"):
        DataConfig(name="pacs", allocation="feddap", clients_per_domain=2)
    # a data preset's allocation too, before anything is loaded or made
    from protofl.engine.federated_data import preflight

    old_style = ExperimentConfig().with_overrides(
        ["data.preset=vpdr", "data.name=pacs", "data.clients_per_domain=2"]
    )
    with pytest.raises(ValueError, match=r"data\.clients_per_domain=2 .*data\.preset='vpdr'"):
        preflight(old_style)


# ------------------------------------------------------------------------- protofl config
def test_protofl_config_prints_the_resolved_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "--set", "preset=vpdr"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["preset"] == "vpdr"
    assert printed["federation"]["batch_size"] == 256 and printed["federation"]["rounds"] == 20
    assert printed["backbone"]["train_projection"] is False
    assert printed["privacy"]["mechanism"] == "vpdr" and printed["method"]["params"] == {"lam": 0.1}
    path = tmp_path / "exp.yaml"
    path.write_text("preset: feddap\ndata:\n  name: pacs\n")
    assert main(["config", str(path), "--set", "federation.rounds=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["federation"]["rounds"] == 3 and printed["federation"]["optimizer"] == "sgd"
    assert printed["federation"]["batch_size"] == 16 and printed["run"]["headline"] == "last5"
    assert printed["data"]["allocation"] == "feddap" and printed["method"]["name"] == "feddap"
    # what it printed reads back to the same config, preset and all
    (tmp_path / "printed.yaml").write_text(yaml.safe_dump(printed))
    assert ExperimentConfig.from_yaml(tmp_path / "printed.yaml") == ExperimentConfig.from_yaml(
        path
    ).with_overrides(["federation.rounds=3"])


# --------------------------------------------------------------------------------- resume
def test_a_stored_preset_config_resumes(tmp_path: Path) -> None:
    config = ExperimentConfig().with_overrides(
        ["preset=feddap", "data.name=pacs", "method.name=fpl", "method.params.temperature=0.1"]
    )
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    write_record(tmp_path, config)
    again = ExperimentConfig.from_yaml(tmp_path / "config.yaml")
    assert again == config
    check_resume(tmp_path, again)  # no difference
    # an edit is still refused, preset or not
    edited = again.with_overrides(["federation.local_epochs=2"])
    with pytest.raises(ConfigError, match=re.escape("federation.local_epochs: 10 -> 2")):
        check_resume(tmp_path, edited)
    # the headline is how results are reported, not what they are: it may change
    check_resume(tmp_path, again.with_overrides(["run.headline=final"]))


def test_a_record_made_before_new_keys_existed_still_resumes(tmp_path: Path) -> None:
    config = ExperimentConfig()
    write_record(tmp_path, config)
    record = json.loads((tmp_path / RECORD).read_text())
    for section, key in (
        ("federation", "optimizer"),
        ("federation", "momentum"),
        ("run", "headline"),
    ):
        del record["config"][section][key]
    del record["config"]["preset"], record["config"]["data"]["fraction_unit"]
    (tmp_path / RECORD).write_text(json.dumps(record))
    check_resume(tmp_path, config)
    with pytest.raises(ConfigError, match=re.escape("federation.optimizer: 'adamw' -> 'sgd'")):
        check_resume(tmp_path, config.with_overrides(["federation.optimizer=sgd"]))


def _toy_preset_run(monkeypatch: pytest.MonkeyPatch, preset: str, rounds: int) -> dict[str, Any]:
    """A preset on the generated ``toy`` set (given its own entry for the test)."""
    monkeypatch.setitem(
        PRESETS[preset].datasets,  # type: ignore[arg-type]
        "toy",
        {"data.train_fraction": 1.0, "data.fraction_unit": "domain", "data.allocation": None},
    )
    return {
        "preset": preset,
        "data": {"name": "toy", "domains": ["red", "blue"]},
        "backbone": {"name": "pixels", "image_size": 16, "proto_dim": 32, "adapter_hidden": 8},
        "federation": {"rounds": rounds, "local_epochs": 1, "batch_size": 32},
        "privacy": {"epsilon": 8.0, "clip": 1.0},
        "run": {"progress": False, "save_releases": False},
    }


def test_a_preset_run_resumes_and_reports_its_headline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protofl.engine.runner import resume_experiment, run_experiment

    raw = _toy_preset_run(monkeypatch, "vpdr", rounds=2)
    config = ExperimentConfig.from_dict(raw)
    assert config.privacy.mechanism == "vpdr" and config.backbone.train_projection is False
    result = run_experiment(config, out=tmp_path)
    assert result.summary["preset"] == "vpdr"
    assert result.summary["headline"] == {"metric": "final", "avg_acc": result.summary["avg_acc"]}
    stored = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert stored["preset"] == "vpdr" and stored["federation"]["local_epochs"] == 1
    resumed = resume_experiment(result.run_dir, progress=False)
    assert resumed.summary["avg_acc"] == result.summary["avg_acc"]


def test_the_feddap_preset_trains_with_sgd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from protofl.engine.federated_data import build_federated_data
    from protofl.engine.simulation import Simulation

    raw = _toy_preset_run(monkeypatch, "feddap", rounds=1)
    config = ExperimentConfig.from_dict(raw)
    sim = Simulation(config, build_federated_data(config, tmp_path))
    opt = sim.clients[0].optimizer
    assert type(opt) is torch.optim.SGD
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.01, 0.9, 1e-5)
    # AdamW stays the default, its beta1 is federation.momentum
    plain = ExperimentConfig.from_dict({**raw, "preset": None, "method": {"name": "fedproto"}})
    adamw = Simulation(plain, build_federated_data(plain, tmp_path)).clients[0].optimizer
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["betas"] == (0.9, 0.999)


# ----------------------------------------------------------------------------------- docs
def test_docs_list_every_preset_key() -> None:
    """docs/methods.md's preset table has a row (with its source) for every key a preset sets."""
    text = DOCS.read_text()
    section = text[text.index("## Experiment presets") :]
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z_.0-9]+)` \|", section, re.M)}
    for preset in PRESETS.values():
        for dataset in preset.datasets:
            for method in [*preset.methods, "local"]:
                for key in preset_settings(preset.name, dataset, method):
                    short = key.removeprefix("method.params.")
                    name = f"{method}.{short}" if key.startswith("method.params.") else key
                    assert name in rows, f"docs/methods.md presets table lacks `{name}`"


def test_the_dp_testbed_has_a_text_entry_that_matches_testbed_text_yaml() -> None:
    """``preset: dp_testbed`` on rotten_tomatoes is experiments/testbed_text.yaml's base (the
    text testbed where IGPP at epsilon 1 costs 6.5 AVG, docs/results.md)."""
    got = resolved("dp_testbed", "data.name=rotten_tomatoes")
    sweep = yaml.safe_load((DOCS.parents[1] / "experiments" / "testbed_text.yaml").read_text())
    base = flatten(sweep["base"])
    for key in (
        "backbone.name",
        "data.train_fraction",
        "data.clients_per_domain",
        "data.max_test_per_domain",
        "federation.rounds",
        "federation.local_epochs",
        "method.params.eval",
    ):
        assert got[key] == base[key], key
    assert got["privacy.clip"] == 5.0
