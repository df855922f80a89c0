"""Noise keys: the server, holding the full config and every upload, cannot remove secret noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.engine.federated_data import build_federated_data
from protofl.engine.simulation import Simulation
from protofl.methods.checks import tiny_config
from protofl.privacy.base import Release
from protofl.privacy.guarantee import EVALUATION_GAP
from protofl.privacy.noise import (
    INSECURE_OPT_OUT,
    NoiseKey,
    NoiseKeyError,
    draw_laplace,
    draw_normal,
    noise_key,
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
        gen = NoiseKey.derived(config.seed, c.data.client)
        partition = None
        if config_mechanism == "vpp":
            draw_laplace(gen, (sim.mechanism.dim,), 1.0, "vpp-selection")
            partition = _partition(release, sim.mechanism.k)  # type: ignore[attr-defined]
        noise = draw_normal(gen, tuple(release.prototypes.shape), "gaussian", torch.float32)
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
    assert g["noise_key"] == "secret"
    # the key holds, but every round's per-client accuracy (of a model trained on the private
    # data) is in the run's metrics, outside the mechanism: the guarantee says so
    assert g["not_covered"] == [EVALUATION_GAP] and not g["complete"]
    assert g["statement"].endswith("NOT covered: per-client evaluation")


def test_secret_runs_differ_only_in_the_noise(tmp_path: Path) -> None:
    config = tiny_config("fedproto", "igpp", rounds=1).with_overrides(["privacy.noise_seed=secret"])
    data = build_federated_data(config, tmp_path)
    a, b = Simulation(config, data), Simulation(config, data)
    for ca, cb in zip(a.clients, b.clients):  # data, init, training stream: identical
        assert torch.equal(ca.train_gen.get_state(), cb.train_gen.get_state())
        for pa, pb in zip(ca.model.parameters(), cb.model.parameters()):
            assert torch.equal(pa, pb)
        assert ca.privacy.key.normal(4, "t").tolist() != cb.privacy.key.normal(4, "t").tolist()
    derived = config.with_overrides(["privacy.noise_seed=derived"])
    x, y = Simulation(derived, data), Simulation(derived, data)
    assert x.clients[0].privacy.key.state_dict() == y.clients[0].privacy.key.state_dict()


def test_a_deployment_refuses_a_derived_key_unless_the_node_opts_out() -> None:
    assert resolve_noise_mode("auto", deployment=True) == "secret"
    assert resolve_noise_mode("auto", deployment=False) == "derived"
    with pytest.raises(NoiseKeyError, match=r"privacy\.noise_seed='derived'") as info:
        resolve_noise_mode("derived", deployment=True)
    assert INSECURE_OPT_OUT in str(info.value)
    assert resolve_noise_mode("derived", deployment=True, opt_out=True) == "derived"
    assert noise_key("derived", 3, 1).state_dict() == NoiseKey.derived(3, 1).state_dict()
    assert noise_key("secret", 3, 1).normal(3, "x").tolist() != (
        noise_key("secret", 3, 1).normal(3, "x").tolist()
    )
    with pytest.raises(NoiseKeyError, match="unknown"):
        resolve_noise_mode("config", deployment=False)


# ----- the key itself: as an attacker with the uploads would try it ----------------------------
def _key(value: int) -> NoiseKey:
    """A secret-mode key whose 256 bits are ``value`` (little-endian): for the brute force."""
    return NoiseKey(value.to_bytes(32, "little"), mode="secret")


def test_torch_generators_keep_32_bits_of_their_seed_which_is_why_keys_are_not_seeds() -> None:
    """The failure on main: a 63-bit 'secret' seed in torch's CPU generator is a 32-bit key."""
    a = torch.randn(8, generator=torch.Generator().manual_seed(5))
    b = torch.randn(8, generator=torch.Generator().manual_seed(5 + 2**40))
    assert torch.equal(a, b)  # bit 40 of the seed changes nothing
    # a NoiseKey: every bit of the 256 counts, the high ones too
    base = _key(5).normal(8, "gaussian")
    for bit in (0, 31, 32, 40, 63, 64, 128, 255):
        assert not np.array_equal(_key(5 ^ (1 << bit)).normal(8, "gaussian"), base), bit


def test_a_brute_force_over_the_low_2_20_keys_finds_nothing() -> None:
    """The attack of issue 41 at reduced width: the server knows the upload's noise_std and that
    the clean prototype has norm <= R; it regenerates the first noise values under each
    candidate key and keeps a key whose residual lies in the ball.  Against a secret key (256
    random bits) no candidate in the low 2^20 survives; a planted weak key is found, which
    shows the search would work."""
    rng = np.random.default_rng(0)
    d, radius, std = 32, 1.0, 0.5
    clean = rng.normal(size=d)
    clean *= 0.9 * radius / np.linalg.norm(clean)

    def upload(key: NoiseKey) -> np.ndarray:
        return clean + std * key.normal(d, "gaussian")

    def survivors(observed: np.ndarray, width: int) -> list[int]:
        found = []
        for cand in range(2**width):
            noise = _key(cand).normal(d, "gaussian")
            if np.linalg.norm(observed - std * noise) <= radius:
                found.append(cand)
        return found

    weak = 12_345  # a key inside the searched range: the search finds it
    assert survivors(upload(_key(weak)), 14) == [weak]
    secret = NoiseKey.secret()
    observed = upload(secret)
    width = 20
    hits = 0
    step = 2**16  # the 2^20 candidates in vectorised chunks
    for start in range(0, 2**width, step):
        batch = np.stack([_key(c).normal(d, "gaussian") for c in range(start, start + step)])
        hits += int((np.linalg.norm(observed - std * batch, axis=1) <= radius).sum())
    assert hits == 0


def test_the_key_ratchets_so_a_leaked_key_does_not_regenerate_past_noise() -> None:
    key = NoiseKey.derived(7, 1)
    first = key.normal(32, "gaussian")
    leaked = NoiseKey(key._key, mode="derived", draws=key.draws)  # what a leak would expose
    second = key.normal(32, "gaussian")
    assert np.array_equal(leaked.normal(32, "gaussian"), second)  # the future, yes
    # the past: no draw of the leaked state, for any purpose or draw index, gives the first
    for purpose in ("gaussian", "vpp-selection", "random-partition"):
        probe = NoiseKey(key._key, mode="derived", draws=0)
        assert not np.array_equal(probe.normal(32, purpose), first)
    assert "key" not in NoiseKey.secret().state_dict()
    assert "NoiseKey(mode='secret'" in repr(NoiseKey.secret())


def test_draws_are_standard_gaussian_and_laplace() -> None:
    key = NoiseKey.derived(0, 0)
    z = key.normal(200_000, "gaussian")
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1.0) < 0.01
    assert abs(np.mean(np.abs(z) < 1.0) - 0.6827) < 0.005
    lap = draw_laplace(key, (200_000,), 2.0, "vpp-selection").numpy()
    assert abs(lap.mean()) < 0.03 and abs(np.mean(np.abs(lap)) - 2.0) < 0.03
    u = key.uniform(100_000, "u")
    assert u.min() > 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.005
    perm = NoiseKey.derived(0, 0).permutation(50, "p")
    assert sorted(perm.tolist()) == list(range(50))


# ----- keys never beside the results: the run-folder read of issue 41 ---------------------------
def _planted_keys(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Make every secret key a recognisable one (the test must know the keys to search for)."""
    import os

    drawn: list[bytes] = []

    def token_bytes(n: int) -> bytes:
        key = b"KEY!" + len(drawn).to_bytes(4, "little") + os.urandom(n - 8)
        drawn.append(key)
        return key

    monkeypatch.setattr("protofl.privacy.noise.secrets.token_bytes", token_bytes)
    return drawn


def _files_holding(keys: list[bytes], *folders: Path) -> list[str]:
    found = []
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                if any(k in data or k.hex().encode() in data for k in keys):
                    found.append(str(path))
    return found


def test_no_file_a_run_writes_holds_a_secret_key_and_resume_and_extend_draw_fresh_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On main, checkpoints held each client's generator state (the key) and the noise could be
    regenerated from them.  Now no file of the run, its client-local folder or its checkpoints
    holds any key drawn; a resumed run and an extended run draw fresh keys, so no round's noise
    is ever drawn twice under the same key."""
    from protofl.engine.runner import extend_experiment, resume_experiment, run_experiment

    keys = _planted_keys(monkeypatch)
    config = tiny_config("fedproto", "igpp", rounds=2).with_overrides(
        ["privacy.noise_seed=secret", "federation.checkpoint=true", "federation.keep_checkpoints=2"]
    )
    result = run_experiment(config, out=tmp_path / "runs", home=tmp_path / "home")
    first = len(keys)
    assert first == 2  # one per client
    assert not _files_holding(keys, tmp_path / "runs")
    checkpoints = sorted(result.run_dir.glob("checkpoint-*.pt"))
    assert checkpoints
    state = torch.load(checkpoints[-1], weights_only=False)
    for client in state["clients"]:
        assert client["noise_gen"] == {"mode": "secret", "draws": client["noise_gen"]["draws"]}
    # resume from the round-1 checkpoint: round 2 is drawn again, under new keys
    for extra in checkpoints[1:]:
        extra.unlink()
    (result.run_dir / "summary.json").unlink()
    resumed = resume_experiment(result.run_dir, home=tmp_path / "home")
    assert len(keys) == first + 2 and len(set(keys)) == len(keys)
    extend_experiment(resumed.run_dir, 1, home=tmp_path / "home")
    assert len(keys) == first + 4 and len(set(keys)) == len(keys)
    assert not _files_holding(keys, tmp_path / "runs")


def test_no_flower_node_file_or_context_holds_a_secret_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """protofl's Flower simulation with a run folder keeps node files in <run>/nodes/: on main
    they (and the Contexts) held each client's generator state, starting with its seed."""
    from protofl.engine.flower.run import run_flower_simulation

    keys = _planted_keys(monkeypatch)
    config = tiny_config("fedproto", "vpp", rounds=2).with_overrides(["privacy.noise_seed=secret"])
    result = run_flower_simulation(
        config, home=tmp_path / "home", backend="inline", out=tmp_path / "runs"
    )
    assert result.run_dir is not None and list((result.run_dir / "nodes").rglob("*.pt"))
    assert len(keys) == 2
    assert not _files_holding(keys, tmp_path / "runs")


def test_a_child_key_costs_its_parent_one_draw_whatever_the_child_draws() -> None:
    from protofl.privacy.noise import NoiseKey, child_source

    a, b = NoiseKey.derived(0, 1), NoiseKey.derived(0, 1)
    ca = child_source(a, "rounding")
    cb = child_source(b, "rounding")
    assert ca.mode == "derived" and a.draws == b.draws == 1
    ca.uniform(5, "x")  # the child draws a data-dependent number of times ...
    assert (a.uniform(3, "noise") == b.uniform(3, "noise")).all()  # ... the parent never sees it
    assert (cb.uniform(5, "x") != NoiseKey.derived(0, 1).uniform(5, "x")).all()
    assert child_source(NoiseKey.secret(), "r").mode == "secret"
