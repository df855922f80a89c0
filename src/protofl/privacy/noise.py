"""Noise keys: where a client's privacy noise comes from, and who could reproduce it.

Local DP protects a client against the server.  The Gaussian noise of a release (and VPP's
Laplace selection noise) therefore has to come from randomness the server cannot reproduce: if
the noise generator is seeded from the experiment config, whoever holds the config (the Flower
server does) can regenerate every draw and subtract it, and the release is the noiseless
prototype.  Two modes (``privacy.noise_seed``):

* ``secret``: each client draws a 63-bit key from the operating system (:mod:`secrets`) once,
  keeps it (and its generator's state) to itself, and never sends it.  The guarantee holds
  against the server and anyone who sees the uploads.
* ``derived``: the key is derived from the config's seed and the client id.  Runs repeat
  exactly, noise included (research runs, tests), but **anyone holding the config can remove the
  noise**: the DP guarantee does not hold against the server.

``auto`` (the default) resolves to ``derived`` where the experimenter holds every client and
the server (the in-process simulator, protofl's Flower simulation) and to ``secret`` in a
deployment.  A deployment refuses ``derived`` unless the node itself (its own node config, not
the server's run config) opts out with :data:`INSECURE_OPT_OUT`.
"""

from __future__ import annotations

import secrets

import torch

from protofl.seeding import Stream, derive_seed

NOISE_SEED_MODES = ("auto", "derived", "secret")

INSECURE_OPT_OUT = "insecure-derived-noise-key"
"""Node-config key with which a SuperNode's operator accepts a config-derived noise key (tests
only: the server can then remove that node's noise)."""

NOISE_STREAM = int(Stream.NOISE)
"""The seed path ``(seed, NOISE_STREAM, client)`` of a derived noise key."""

NOISE_KEY_NOTES = {
    "derived": (
        "noise key derived from the config's seed: anyone holding the config (the server too) "
        "can regenerate the noise and remove it, so the guarantee does NOT hold against the "
        "server; for reproducible research runs only"
    ),
    "secret": (
        "noise key drawn from the operating system's randomness on the client and never sent: "
        "the server cannot reproduce the noise"
    ),
}


class NoiseKeyError(ValueError):
    """A noise-key mode that would void the guarantee where it runs."""


def secret_seed() -> int:
    """A fresh 63-bit key from the operating system's randomness."""
    return secrets.randbits(63)


def resolve_noise_mode(configured: str, *, deployment: bool, opt_out: bool = False) -> str:
    """``derived`` or ``secret`` for ``privacy.noise_seed=configured`` where it runs.

    ``deployment``: clients run on their own nodes, so the server must not be able to reproduce
    their noise: ``auto`` means ``secret`` and ``derived`` is refused unless ``opt_out`` (the
    node's own :data:`INSECURE_OPT_OUT`).
    """
    if configured not in NOISE_SEED_MODES:
        raise NoiseKeyError(
            f"privacy.noise_seed={configured!r} is unknown; choose one of: "
            + ", ".join(NOISE_SEED_MODES)
        )
    if configured == "auto":
        return "secret" if deployment else "derived"
    if configured == "derived" and deployment and not opt_out:
        raise NoiseKeyError(
            "privacy.noise_seed='derived' in a deployment would let the server (which holds the "
            "config) remove every client's noise; use 'secret' or 'auto', or set the node config "
            f"'{INSECURE_OPT_OUT}=true' on each SuperNode for a test"
        )
    return configured


def noise_seed(mode: str, seed: int, client: int) -> int:
    """The seed of one client's noise generator: derived from (seed, client), or secret."""
    if mode == "derived":
        return derive_seed(seed, NOISE_STREAM, client)
    if mode == "secret":
        return secret_seed()
    raise NoiseKeyError(f"noise key mode {mode!r} is not resolved (derived or secret)")


def noise_generator(mode: str, seed: int, client: int) -> torch.Generator:
    """A client's noise generator for a resolved mode (see :func:`noise_seed`)."""
    return torch.Generator().manual_seed(noise_seed(mode, seed, client))
