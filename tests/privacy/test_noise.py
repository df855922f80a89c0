"""Noise keys: the server, holding the full config and every upload, cannot remove secret noise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protofl.engine.federated_data import build_federated_data
from protofl.engine.simulation import Simulation
from protofl.methods.checks import tiny_config
from protofl.privacy.base import Release
from protofl.privacy.noise import (
    INSECURE_OPT_OUT,
    NoiseKeyError,
    derive_seed,
    noise_seed,
    resolve_noise_mode,
)


def _truth(sim: Simulation) -> dict[int, torch.Tensor]:
    """The noiseless prototypes of round 1 (what local DP hides from the server)."""
    out = {}
    for c in sim.clients:
        c.model.eval()
        with torch.no_grad():
            feats = sim.method.upload_features(c.model, c.data.train_z.float())
        out[c.data.client] = feats
    return out


def _partition(release: Release, k: int) -> torch.Tensor:
    """VPP's released partition A, read off the public per-dimension noise std."""
    row = release.noise_std[0]
    values, counts = torch.unique(row, return_counts=True)
    return row == values[counts == k][0]


def _server_recovers(
    config_mechanism: str, noise_seed_mode: str, home: Path
) -> tuple[float, float]:
    """Play the server: regenerate each client's noise from the config and subtract it.
    Returns (largest recovery error, smallest noise std) over clients and prototypes."""
    config = tiny_config("fedproto", config_mechanism, rounds=2).with_overrides(
        [f"privacy.noise_seed={noise_seed_mode}"]
    )
    sim = Simulation(config, build_federated_data(config, home))
    feats = _truth(sim)
    sim.run_round()
    worst_err, least_std = 0.0, float("inf")
    for c, release in zip(sim.clients, sim.releases[0]):
        assert release is not None
        # everything below is what the server holds: the config and the upload
        gen = torch.Generator().manual_seed(derive_seed(config.seed, 3, c.data.client))
        partition = None
        if config_mechanism == "vpp":
            torch.rand((2, sim.mechanism.dim), generator=gen, dtype=torch.float64)  # Laplace
            partition = _partition(release, sim.mechanism.k)  # type: ignore[attr-defined]
        noise = torch.randn(release.prototypes.shape, generator=gen, dtype=torch.float32)
        recovered = release.prototypes - noise * release.noise_std
        truth = sim.mechanism.noiseless_release(  # type: ignore[attr-defined]
            feats[c.data.client],
            c.data.train_y,
            num_classes=sim.data.num_classes,
            partition=partition,
        ).prototypes
        worst_err = max(worst_err, float((recovered - truth).abs().max()))
        least_std = min(least_std, float(release.noise_std.min()))
    return worst_err, least_std


@pytest.mark.parametrize("mechanism", ["igpp", "vpp"])
def test_the_server_removes_derived_noise_but_not_secret_noise(
    mechanism: str, tmp_path: Path
) -> None:
    err, std = _server_recovers(mechanism, "derived", tmp_path)
    assert err < 1e-4 * std  # the attack works: derived noise is no protection
    err, std = _server_recovers(mechanism, "secret", tmp_path)
    assert err > std  # recovered prototypes are as far from the truth as the noise


def test_auto_is_derived_in_simulation_and_the_summary_says_what_that_means(
    tmp_path: Path,
) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1)
    sim = Simulation(config, build_federated_data(config, tmp_path))
    assert config.privacy.noise_seed == "auto" and sim.noise_mode == "derived"
    g = sim.guarantee()
    assert g["noise_key"] == "derived" and g["complete"] is False
    assert "server" in g["noise_key_note"] and "remove" in g["noise_key_note"]
    assert "NOT covered: the noise itself" in g["statement"]
    secret = config.with_overrides(["privacy.noise_seed=secret"])
    g = Simulation(secret, build_federated_data(secret, tmp_path)).guarantee()
    assert g["noise_key"] == "secret" and g["complete"] and g["holds_against_server"]


def test_secret_runs_differ_only_in_the_noise(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(["privacy.noise_seed=secret"])
    data = build_federated_data(config, tmp_path)
    a, b = Simulation(config, data), Simulation(config, data)
    for ca, cb in zip(a.clients, b.clients):  # data, init, training stream: identical
        assert torch.equal(ca.train_gen.get_state(), cb.train_gen.get_state())
        for pa, pb in zip(ca.model.parameters(), cb.model.parameters()):
            assert torch.equal(pa, pb)
        assert not torch.equal(ca.noise_gen.get_state(), cb.noise_gen.get_state())
    derived = config.with_overrides(["privacy.noise_seed=derived"])
    x, y = Simulation(derived, data), Simulation(derived, data)
    assert torch.equal(x.clients[0].noise_gen.get_state(), y.clients[0].noise_gen.get_state())


def test_a_deployment_refuses_a_derived_key_unless_the_node_opts_out() -> None:
    assert resolve_noise_mode("auto", deployment=True) == "secret"
    assert resolve_noise_mode("auto", deployment=False) == "derived"
    with pytest.raises(NoiseKeyError, match=r"privacy\.noise_seed='derived'") as info:
        resolve_noise_mode("derived", deployment=True)
    assert INSECURE_OPT_OUT in str(info.value)
    assert resolve_noise_mode("derived", deployment=True, opt_out=True) == "derived"
    assert noise_seed("derived", 3, 1) == derive_seed(3, 3, 1)
    assert noise_seed("secret", 3, 1) != noise_seed("secret", 3, 1)
    with pytest.raises(NoiseKeyError, match="unknown"):
        resolve_noise_mode("config", deployment=False)
