"""Noise keys: where a client's privacy noise comes from, and who could reproduce it.

Local DP protects a client against the server.  The Gaussian noise of a release (and VPP's
Laplace selection noise) therefore has to come from randomness the server cannot reproduce: if
the noise could be regenerated (from the experiment config, or by guessing a short key), whoever
holds the uploads could subtract it, and the release would be the noiseless prototype.

Every draw comes from a :class:`NoiseKey`: a 256-bit key, and a SHAKE-256 keystream (FIPS 202)
per draw, keyed by the current key and labelled by the draw's purpose and index,
``SHAKE256("protofl/noise/v1" | key | purpose | index)``.  After each draw the key is ratcheted,
``key <- SHA-256("protofl/ratchet/v1" | key)``, a one-way step: a key read at any point (a
leaked process, a saved state) regenerates the draws after it, never the ones before.  The
uniforms have 53 random bits each; Gaussians come from the Box-Muller transform and Laplace
draws from the difference of two exponentials, in float64 on the CPU (then cast and moved to
where the features are).  Brute force is over 2^256 keys.

Two modes (``privacy.noise_seed``):

* ``secret``: the key is 32 bytes from the operating system (:func:`secrets.token_bytes`),
  drawn by the client in its own process and never written anywhere: not in checkpoints, not in
  artifacts, not in a Flower ``Context``.  A client process that restarts (a resumed run, the
  next Flower message) draws a fresh key, so no noise is ever replayed.  The guarantee holds
  against the server and anyone who sees the uploads.
* ``derived``: the key is derived from the config's seed and the client id.  Runs repeat
  exactly, noise included (research runs, tests), but **anyone holding the config can remove the
  noise**: the DP guarantee does not hold against the server.

``auto`` (the default) resolves to ``derived`` where the experimenter holds every client and
the server (the in-process simulator, protofl's Flower simulation) and to ``secret`` in a
deployment.  A deployment refuses ``derived`` unless the node itself (its own node config, not
the server's run config) opts out with :data:`INSECURE_OPT_OUT`.

A plain ``torch.Generator`` is still accepted by the mechanisms (:data:`NoiseSource`), for
tests and for the audit's simulated trials: its Mersenne Twister has 32 bits of seed and is
**not** a noise key; protofl's engines and :class:`~protofl.privacy.PrototypePrivacy` never
use one for noise.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from typing import Any, Union

import numpy as np
import torch

from protofl.seeding import Stream, derive_seed

NOISE_SEED_MODES = ("auto", "derived", "secret")

INSECURE_OPT_OUT = "insecure-derived-noise-key"
"""Node-config key with which a SuperNode's operator accepts a config-derived noise key (tests
only: the server can then remove that node's noise)."""

NOISE_STREAM = int(Stream.NOISE)
"""The seed path ``(seed, NOISE_STREAM, client)`` of a derived noise key."""

KEY_BYTES = 32
"""A noise key's length: 256 bits."""

NOISE_KEY_NOTES = {
    "derived": (
        "noise key derived from the config's seed: anyone holding the config (the server too) "
        "can regenerate the noise and remove it, so the guarantee does NOT hold against the "
        "server; for reproducible research runs only"
    ),
    "secret": (
        "256-bit noise key drawn from the operating system's randomness on the client, kept in "
        "its memory only (never saved or sent) and ratcheted after every draw: the server "
        "cannot reproduce the noise (SHAKE-256 keystream)"
    ),
}

_DOMAIN = b"protofl/noise/v1"
_RATCHET = b"protofl/ratchet/v1"
_DERIVE = b"protofl/derived-key/v1"


class NoiseKeyError(ValueError):
    """A noise-key mode that would void the guarantee where it runs."""


class NoiseKey:
    """A client's noise key: 256 bits, a SHAKE-256 keystream per draw, ratcheted after each.

    Use :meth:`secret` (the operating system's randomness) or :meth:`derived` (from a seed and a
    client id: reproducible, and removable by whoever knows them).  ``device`` is the CPU: draws
    are made there and moved by the caller.
    """

    device = torch.device("cpu")

    def __init__(self, key: bytes, *, mode: str, draws: int = 0) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
            raise ValueError(f"a noise key is {KEY_BYTES} bytes, got {type(key).__name__}")
        if mode not in ("derived", "secret"):
            raise NoiseKeyError(f"noise key mode {mode!r} is not resolved (derived or secret)")
        self._key = bytes(key)
        self.mode = mode
        self.draws = int(draws)

    @classmethod
    def secret(cls) -> NoiseKey:
        """A fresh key from the operating system's randomness."""
        return cls(secrets.token_bytes(KEY_BYTES), mode="secret")

    @classmethod
    def derived(cls, seed: int, client: int) -> NoiseKey:
        """The key of ``client`` derived from the experiment ``seed`` (not secret)."""
        path = struct.pack("<qqq", int(seed), NOISE_STREAM, int(client))
        return cls(hashlib.sha256(_DERIVE + path).digest(), mode="derived")

    def __repr__(self) -> str:  # never shows the key
        return f"NoiseKey(mode={self.mode!r}, draws={self.draws})"

    # ----- the keystream -------------------------------------------------------------------------
    def _words(self, count: int, purpose: str) -> np.ndarray:
        """``count`` uniformly random 64-bit words for one draw; then ratchet the key."""
        label = purpose.encode()
        head = _DOMAIN + self._key + struct.pack("<H", len(label)) + label
        block = hashlib.shake_256(head + struct.pack("<Q", self.draws)).digest(8 * count)
        self._key = hashlib.sha256(_RATCHET + self._key).digest()
        self.draws += 1
        return np.frombuffer(block, dtype="<u8")

    def uniform(self, count: int, purpose: str) -> np.ndarray:
        """``count`` float64 uniforms in the open interval (0, 1), 53 random bits each."""
        words = self._words(count, purpose)
        return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53

    def normal(self, count: int, purpose: str) -> np.ndarray:
        """``count`` standard normal float64 draws (Box-Muller)."""
        pairs = (count + 1) // 2
        u = self.uniform(2 * pairs, purpose)
        radius = np.sqrt(-2.0 * np.log(u[:pairs]))
        angle = (2.0 * math.pi) * u[pairs:]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]

    def permutation(self, n: int, purpose: str) -> np.ndarray:
        """A uniformly random permutation of ``range(n)`` (sorting 64-bit random keys)."""
        return np.argsort(self._words(n, purpose), kind="stable")

    def child(self, purpose: str) -> NoiseKey:
        """A fresh key of the same mode made of 256 bits of this key's stream (one draw): for
        a step that draws a data-dependent number of times (ddg's conditional rounding), so
        this key's later draws do not depend on the data."""
        return NoiseKey(self._words(KEY_BYTES // 8, purpose).tobytes(), mode=self.mode)

    # ----- what may be kept ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint may hold: a derived key's state (reproducible from the config
        anyway); for a secret key only its mode and draw count, never the key."""
        if self.mode == "secret":
            return {"mode": "secret", "draws": self.draws}
        return {"mode": "derived", "key": self._key.hex(), "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a derived key from :meth:`state_dict`; a secret key keeps its own fresh key
        (a restored run draws new noise, it never replays old noise)."""
        mode = state.get("mode")
        if mode != self.mode:
            raise NoiseKeyError(
                f"a {mode} noise-key state cannot be loaded into a {self.mode} key "
                "(privacy.noise_seed differs from the saved run's)"
            )
        if mode == "derived":
            self._key = bytes.fromhex(str(state["key"]))
            self.draws = int(state["draws"])


def restore_noise_key(current: NoiseKey, state: Any, *, where: str = "the saved state") -> NoiseKey:
    """The key to continue with after loading ``state`` (:meth:`NoiseKey.state_dict`): a
    derived key at the saved point; for a secret state, ``current`` if it is secret (this
    process's own key) or a fresh secret key: a secret key is never read back.  A state from an
    older protofl (a torch generator's bytes, which held the key) is refused."""
    if not isinstance(state, dict) or state.get("mode") not in ("derived", "secret"):
        raise NoiseKeyError(
            f"{where} holds a noise generator from an older protofl (a 32-bit torch "
            "generator); it cannot be continued: start the run again"
        )
    if state["mode"] == "secret":
        return current if current.mode == "secret" else NoiseKey.secret()
    key = current if current.mode == "derived" else NoiseKey(bytes(KEY_BYTES), mode="derived")
    key.load_state_dict(state)
    return key


NoiseSource = Union[NoiseKey, torch.Generator]  # noqa: UP007 (a runtime alias)
"""What a mechanism draws its noise from: a :class:`NoiseKey` (protofl's engines and facade), or
a ``torch.Generator`` (tests, simulated audit trials: not a secret key)."""


def draw_uniform(source: NoiseSource, shape: tuple[int, ...], purpose: str) -> torch.Tensor:
    """float64 uniforms of ``shape`` on the CPU."""
    if isinstance(source, NoiseKey):
        n = math.prod(shape)
        return torch.from_numpy(source.uniform(n, purpose).reshape(shape))
    return torch.rand(shape, generator=source, device=source.device, dtype=torch.float64).cpu()


def draw_normal(
    source: NoiseSource, shape: tuple[int, ...], purpose: str, dtype: torch.dtype
) -> torch.Tensor:
    """Standard normal draws of ``shape`` and ``dtype`` on the CPU."""
    if isinstance(source, NoiseKey):
        n = math.prod(shape)
        return torch.from_numpy(source.normal(n, purpose).reshape(shape)).to(dtype)
    return torch.randn(shape, generator=source, device=source.device, dtype=dtype).cpu()


def draw_laplace(
    source: NoiseSource, shape: tuple[int, ...], scale: float, purpose: str
) -> torch.Tensor:
    """Lap(``scale``) float64 draws as scale*(E1 - E2), E1, E2 ~ Exp(1)."""
    u = draw_uniform(source, (2, *shape), purpose)
    if isinstance(source, NoiseKey):
        e = -torch.log(u)  # u in (0, 1): finite
    else:
        e = -torch.log1p(-u)  # torch.rand is in [0, 1)
    return scale * (e[0] - e[1])


def child_source(source: NoiseSource, purpose: str) -> NoiseSource:
    """A source seeded by one draw of ``source`` (:meth:`NoiseKey.child`; a generator seeded
    from ``source`` for a plain ``torch.Generator``)."""
    if isinstance(source, NoiseKey):
        return source.child(purpose)
    seed = int(torch.randint(0, 2**62, (1,), generator=source, device=source.device))
    return torch.Generator().manual_seed(seed)


def draw_permutation(source: NoiseSource, n: int, purpose: str) -> torch.Tensor:
    """A uniformly random permutation of ``range(n)`` (int64, CPU)."""
    if isinstance(source, NoiseKey):
        return torch.from_numpy(source.permutation(n, purpose).astype(np.int64))
    return torch.randperm(n, generator=source, device=source.device).cpu()


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


def noise_key(mode: str, seed: int, client: int) -> NoiseKey:
    """A client's noise key for a resolved mode: derived from (seed, client), or secret."""
    if mode == "derived":
        return NoiseKey.derived(seed, client)
    if mode == "secret":
        return NoiseKey.secret()
    raise NoiseKeyError(f"noise key mode {mode!r} is not resolved (derived or secret)")


__all__ = [
    "INSECURE_OPT_OUT",
    "KEY_BYTES",
    "NOISE_KEY_NOTES",
    "NOISE_SEED_MODES",
    "NoiseKey",
    "NoiseKeyError",
    "NoiseSource",
    "derive_seed",
    "draw_laplace",
    "draw_normal",
    "draw_permutation",
    "draw_uniform",
    "noise_key",
    "resolve_noise_mode",
    "restore_noise_key",
]
