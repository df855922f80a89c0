"""``ddg``: the distributed discrete Gaussian over secure aggregation (issue 44, item 4).

Where a method's server needs only per-class (FedProto) or per-(class, domain) (FedDAP with
``fusion: mean``) sums and counts, the clients need not be protected one by one against a
server that sees every upload: with secure aggregation the server sees only the SUM of the
clients' vectors, so each client adds a 1/sqrt(n) share of the noise the sum needs (Kairouz,
Liu and Steinke, ICML 2021, arXiv 2102.06387).  Secure aggregation sums integers modulo m, so
the noise must be discrete and the data quantised:

1. **Clip** each example's feature to L2 norm R (``privacy.clip``).
2. **Quantise** it: scale by s/R (s = R/gamma integer units per clip radius, chosen so that the
   sum cannot wrap, below) and round each coordinate randomly up or down (unbiased),
   **conditionally**: a rounded example whose L2 norm exceeds the bound B of
   :func:`~protofl.privacy.ddg_accounting.rounding_norm_bound` is rounded again, so every
   quantised example has norm <= B, always (Kairouz et al., Sec. 4.1).
3. **Sum** the quantised examples per class into the client's block of a [G, C, d] integer
   vector (G groups: 1, or one per domain for FedDAP); the other blocks stay zero.
4. **Noise**: every coordinate gets an independent discrete Gaussian N_Z(0, sigma^2) draw,
   sigma the per-client share (below).  Then reduce modulo m = 2^bits (``privacy.ddg_bits``).
5. The server (secure aggregation: in the simulator the same arithmetic with no cryptography,
   :func:`secure_sum`) adds the vectors modulo m, maps back to the centred range, multiplies by
   gamma and divides each class sum by its public total count: the global prototypes.

**Sensitivity.** One example changes one client's vector by one quantised example (add/remove:
L2 <= B) or by the difference of two (replace-one: L2 <= 2B); L1 <= min(L2^2, sqrt(d) L2) for an
integer vector of that L2 norm.  **Noise.** The sum holds the shares of at least n - t honest
clients, n the clients of a round and t = ``privacy.ddg_max_dropped`` (clients that may drop
out or collude with the server and subtract their own noise); sigma is calibrated so that
``releases`` such sums are (epsilon, delta)-DP by Proposition 14 of the paper
(:mod:`protofl.privacy.ddg_accounting`).  **Wrap.** s is the largest power of two for which
the data part of every coordinate (at most N B, N the federation's training examples) plus 8
noise standard deviations stays inside the centred range; the probability that any coordinate
wraps is bounded in the guarantee (a wrap costs accuracy, never privacy: the server's view is
a function of the noisy sum).

**What the guarantee assumes**: the server follows the protocol and sees nothing but the sum
(the simulator's in-process sum is labelled as such: no cryptography); at most t of a round's
clients drop out or collude with the server; every round has at least n clients (full or fixed
participation, no random dropout).  Against a server that deviates, or sees individual
vectors, each client's own share (sigma alone) is all that protects it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from protofl.privacy.base import (
    MECHANISM_REGISTRY,
    ClusterFn,
    Mechanism,
    Release,
    charge_release,
    check_finite,
)
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.ddg_accounting import calibrate_ddg, rounding_norm_bound, wrap_probability
from protofl.privacy.noise import NoiseSource, child_source, draw_uniform
from protofl.privacy.prototype import clip_l2

log = logging.getLogger(__name__)

WRAP_STDS = 8.0
"""Noise standard deviations of headroom the scale leaves below the modulus."""

_MAX_REROUNDS = 200


def discrete_gaussian(source: NoiseSource, count: int, sigma: float, purpose: str) -> torch.Tensor:
    """``count`` independent draws of N_Z(0, sigma^2) (int64): Canonne, Kamath and Steinke
    (2020), Algorithm 3: a discrete Laplace proposal of scale t = floor(sigma) + 1 (the
    difference of two geometric variables floor(t E), E ~ Exp(1)), accepted with probability
    exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)).  The uniforms come from ``source`` (the client's
    noise key); the arithmetic is float64, not the paper's exact rational sampler."""
    t = math.floor(sigma) + 1.0
    out = torch.empty(0, dtype=torch.int64)
    attempt = 0
    while out.numel() < count:
        need = count - out.numel()
        batch = max(64, int(need * 2.5))
        u = draw_uniform(source, (3, batch), f"{purpose}/{attempt}")
        e = -torch.log1p(-u[:2])  # Exp(1); u in [0, 1)
        y = torch.floor(t * e[0]) - torch.floor(t * e[1])
        accept = u[2] < torch.exp(-((y.abs() - sigma * sigma / t) ** 2) / (2.0 * sigma * sigma))
        out = torch.cat([out, y[accept].to(torch.int64)])
        attempt += 1
    return out[:count]


def conditional_round(
    x: torch.Tensor, bound: float, source: NoiseSource, purpose: str
) -> torch.Tensor:
    """Unbiased randomized rounding of each row of ``x`` (float64), drawn again for the rows
    whose rounded L2 norm exceeds ``bound`` (int64; every row within ``bound``)."""
    floor = torch.floor(x)
    frac = x - floor
    out = floor + (draw_uniform(source, tuple(x.shape), f"{purpose}/0") < frac).to(x.dtype)
    for k in range(1, _MAX_REROUNDS + 1):
        bad = out.square().sum(dim=1) > bound * bound
        if not bool(bad.any()):
            return out.to(torch.int64)
        rows = bad.nonzero().flatten()
        u = draw_uniform(source, (len(rows), x.shape[1]), f"{purpose}/{k}")
        out[rows] = floor[rows] + (u < frac[rows]).to(x.dtype)
    raise RuntimeError(
        f"conditional rounding failed {_MAX_REROUNDS} times (bound {bound:.6g}); raise "
        "privacy.ddg_beta's rounding bound"
    )


@dataclass(frozen=True)
class Federation:
    """What the calibration needs to know of the federation (all public to the server)."""

    groups: Mapping[str, int]  # client name -> its group (0, or its domain index)
    num_groups: int
    num_classes: int
    per_round: int  # clients in every round (participation)
    examples: int  # training examples over all clients (public counts)


@MECHANISM_REGISTRY.register("ddg")
class DistributedDiscreteGaussian(Mechanism):
    """Clip, quantise (conditional randomized rounding), per-class integer sums in the client's
    group block, a discrete Gaussian share of the noise, modulo 2^bits; the server sees only
    the sum (:func:`secure_sum`).  Calibrated by :meth:`bind` (the federation's size)."""

    name = "ddg"
    secure_sum_mechanism: ClassVar[bool] = True
    auditable: ClassVar[bool] = False  # the per-client audit has no sum view (docs/attacks.md)

    def __init__(self, config: PrivacyConfig, *, rounds: int, dim: int) -> None:
        super().__init__(config, rounds=rounds, dim=dim)
        self.federation: Federation | None = None
        self._released: dict[str, int] = {}

    @classmethod
    def check_run(cls, config: Any, method: Any) -> None:
        """The run settings the guarantee needs, refused in one line naming the setting before
        anything starts: the in-process engine, a fixed number of clients every round (no
        random dropout; partial participation only with fresh noise every round), no poisoned
        clients, and a method whose server needs only sums (:meth:`Method.secure_sum_groups`)."""
        if not method.uses_prototypes:
            return  # nothing released: the mechanism-scope warning says so
        if config.run.engine != "sim":
            raise ValueError(
                f"privacy.mechanism=ddg runs on run.engine=sim only (the in-process secure sum); "
                f"secure aggregation over Flower's SecAgg+ is not built yet (run.engine="
                f"{config.run.engine})"
            )
        fed = config.federation
        if fed.dropout > 0:
            raise ValueError(
                f"federation.dropout={fed.dropout} drops a random number of clients, so no "
                "number of honest noise shares holds every round; privacy.mechanism=ddg needs "
                "federation.dropout=0 (privacy.ddg_max_dropped states the dropouts tolerated)"
            )
        if fed.participation < 1 and config.privacy.release_schedule == "once":
            raise ValueError(
                f"federation.participation={fed.participation} with release_schedule=once would "
                "sum the same noisy vectors over different subsets (their difference isolates "
                "one client's share); use participation 1 or release_schedule=every_round"
            )
        if fed.poison:
            raise ValueError(
                "federation.poison sends a flipped release, which a secure sum cannot single "
                "out; not supported with privacy.mechanism=ddg"
            )
        method.secure_sum_groups()
        domains, data = config.data.domains, config.data
        if domains is not None and data.allocation is None and data.preset is None:
            # the federation's size is known from the config: the threshold is checked now
            total = len(domains) * data.clients_per_domain
            per_round = total if fed.participation >= 1 else math.ceil(fed.participation * total)
            cls.check_threshold(config.privacy.ddg_max_dropped, max(per_round, 1))

    @staticmethod
    def check_threshold(max_dropped: int, per_round: int) -> None:
        """Refuse a dropout/collusion threshold that leaves no honest client in a round."""
        if per_round - max_dropped < 1:
            raise ValueError(
                f"privacy.ddg_max_dropped={max_dropped} leaves no honest client: a round has "
                f"{per_round} client(s); the sum's noise needs at least one more than the "
                "clients that may drop out or collude"
            )

    # ----- calibration ------------------------------------------------------------------------
    def bind(self, federation: Federation) -> None:
        """Calibrate for ``federation``: honest contributors n - t, scale s, rounding bound B,
        sensitivities, sigma; refuses (one line naming the setting) a federation too small for
        ``privacy.ddg_max_dropped`` or a modulus too small for the data."""
        cfg = self.config
        t = cfg.ddg_max_dropped
        self.check_threshold(t, federation.per_round)
        self.federation = federation
        self.honest = federation.per_round - t
        self.coords = federation.num_groups * federation.num_classes * self.dim
        # the largest power-of-two scale whose data part alone fits, then down until the noise's
        # headroom fits too
        top = math.floor(math.log2(2.0 ** (cfg.ddg_bits - 1) / max(federation.examples, 1)))
        for bits in range(top, 0, -1):
            if self._try_scale(2.0**bits, federation):
                return
        raise ValueError(
            f"privacy.ddg_bits={cfg.ddg_bits} is too small for {federation.examples} training "
            "examples and this noise: the sum would wrap; raise privacy.ddg_bits"
        )

    def _try_scale(self, scale: float, federation: Federation) -> bool:
        cfg = self.config
        bound = rounding_norm_bound(scale, self.dim, cfg.ddg_beta)
        factor = 2.0 if cfg.neighbouring == "replace_one" else 1.0
        l2 = factor * bound
        l1 = min(l2 * l2, math.sqrt(self.dim) * l2)
        sigma = calibrate_ddg(
            cfg.epsilon, cfg.delta, self.rounds, l2=l2, l1=l1, clients=self.honest, dim=self.coords
        )
        headroom = 2.0 ** (cfg.ddg_bits - 1) - 1.0 - federation.examples * bound
        if headroom < WRAP_STDS * math.sqrt(federation.per_round) * sigma:
            return False
        self.scale, self.bound, self.l2, self.l1, self.sigma = scale, bound, l2, l1, sigma
        self.gamma = cfg.clip / scale
        self.wrap = wrap_probability(
            bits=cfg.ddg_bits,
            examples=federation.examples,
            example_bound=bound,
            sigma=sigma,
            clients=federation.per_round,
            coords=self.coords,
        )
        return True

    def restore_calibration(self, facts: Mapping[str, Any]) -> None:
        """Take the calibration a finished run recorded (its summary's privacy facts, from
        :meth:`describe`), for what needs only the events (``protofl extend``'s epsilon); a
        release still needs :meth:`bind`."""
        try:
            self.l2 = float(facts["l2_sensitivity"])
            self.l1 = float(facts["l1_sensitivity"])
            self.sigma = float(facts["sigma_per_client"])
            self.honest = int(facts["honest_clients"])
            self.coords = int(facts["coords"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                "the run's summary.json holds no ddg calibration (privacy.sigma_per_client, "
                "l1_sensitivity, coords, ...); it was made before they were recorded"
            ) from None
        self._restored = True

    def _bound(self) -> Federation:
        if self.federation is None:
            raise RuntimeError(
                "privacy.mechanism=ddg is calibrated for a federation (its clients, groups and "
                "examples); the engine binds it before the first release"
            )
        return self.federation

    def event(self) -> dict[str, Any]:
        """The ledger event of one release (Proposition 14's parameters)."""
        if not getattr(self, "_restored", False):
            self._bound()
        return {
            "kind": "ddg",
            "l2": self.l2,
            "l1": self.l1,
            "sigma": self.sigma,
            "clients": self.honest,
            "dim": self.coords,
        }

    def release_events(self, release_index: int) -> list[dict[str, Any]]:
        """One ``ddg`` event per release."""
        return [self.event()]

    # ----- one client's share -----------------------------------------------------------------
    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        generator: NoiseSource,
        client: str = "client",
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """The client's noisy integer vector modulo 2^bits, as a Release whose ``prototypes``
        are the [G*C, d] int64 residues (meaningless alone: only the sum decodes)."""
        fed = self._bound()
        if cluster_fn is not None:
            raise ValueError("privacy.mechanism=ddg releases class sums, not cluster prototypes")
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ValueError(f"client {client!r}: features must have shape [n, {self.dim}]")
        check_finite(features, client)
        if client not in fed.groups:
            raise ValueError(f"client {client!r} is not in the federation ddg was bound to")
        charge_release(self._released, client, self.rounds)
        x = clip_l2(features.detach().to("cpu", torch.float64), self.config.clip)
        # the rounding draws again for rows over the bound (a data-dependent number of draws):
        # from a child of the key, so the key's later draws (the noise) do not depend on it
        rounding = child_source(generator, "ddg-rounding")
        q = conditional_round(x * (self.scale / self.config.clip), self.bound, rounding, "ddg")
        g, c, d = fed.num_groups, num_classes, self.dim
        y = labels.to("cpu", torch.int64)
        vec = torch.zeros(g, c, d, dtype=torch.int64)
        vec[fed.groups[client]].index_add_(0, y, q)
        noise = discrete_gaussian(generator, g * c * d, self.sigma, "ddg-noise").view(g, c, d)
        modulus = 2**self.config.ddg_bits
        share = torch.remainder(vec + noise, modulus).view(g * c, d)
        counts = torch.zeros(g, c, dtype=torch.int64)
        counts[fed.groups[client]] = torch.bincount(y, minlength=c)
        return Release(
            prototypes=share,
            classes=torch.arange(c).repeat(g),
            counts=counts.view(-1),
            sensitivity=torch.full((g * c,), self.l2 * self.gamma, dtype=torch.float64),
            noise_std=torch.full((g * c, d), self.sigma * self.gamma, dtype=torch.float64),
            mechanism=self.name,
            events=[self.event()],
            info={"sigma": float(self.sigma), "gamma": float(self.gamma)},
        )

    # ----- the server's sum -------------------------------------------------------------------
    def secure_sum(self, shares: Sequence[Release]) -> list[tuple[int, Release]]:
        """The sum of the clients' shares modulo 2^bits, decoded: per group, a Release of the
        global prototypes (class sums over the public total counts) of the classes present.
        In the simulator this is the in-process equivalent of secure aggregation: the same
        arithmetic, no cryptography (the engine never shows a single share to the method)."""
        fed = self._bound()
        if not shares:
            return []
        modulus = 2**self.config.ddg_bits
        total = torch.zeros_like(shares[0].prototypes)
        counts = torch.zeros_like(shares[0].counts)
        for s in shares:
            total = torch.remainder(total + s.prototypes, modulus)
            counts = counts + s.counts
        centred = torch.where(total >= modulus // 2, total - modulus, total)
        sums = centred.to(torch.float64) * self.gamma
        c = fed.num_classes
        noise_std = math.sqrt(len(shares)) * self.sigma * self.gamma
        out = []
        for g in range(fed.num_groups):
            n = counts[g * c : (g + 1) * c]
            present = (n > 0).nonzero().flatten()
            if present.numel() == 0:
                continue
            rows = g * c + present
            denom = n[present].to(torch.float64)
            out.append(
                (
                    g,
                    Release(
                        prototypes=(sums[rows] / denom[:, None]).to(torch.float32),
                        classes=present,
                        counts=n[present],
                        sensitivity=self.l2 * self.gamma / denom,
                        noise_std=(noise_std / denom)[:, None].expand(-1, self.dim).clone(),
                        mechanism=self.name,
                        info={"contributors": float(len(shares)), "group": float(g)},
                    ),
                )
            )
        return out

    # ----- facts ------------------------------------------------------------------------------
    def calibration(self) -> dict[str, Any]:
        """sigma (per client, integer units) and the scale, once bound."""
        if self.federation is None:
            return {}
        return {"sigma": float(self.sigma), "scale": float(self.scale), "gamma": self.gamma}

    def describe(self) -> dict[str, Any]:
        """The calibration and what the guarantee assumes of the server and of collusion."""
        cfg = self.config
        out: dict[str, Any] = {
            "mechanism": self.name,
            "accountant": "rdp (Kairouz, Liu, Steinke 2021, Proposition 14)",
            "epsilon": cfg.epsilon,
            "delta": cfg.delta,
            "rounds": self.rounds,
            "neighbouring": cfg.neighbouring,
            "clip": cfg.clip,
            "bits": cfg.ddg_bits,
            "max_dropped": cfg.ddg_max_dropped,
            "assumes": (
                "secure aggregation: the server follows the protocol and sees only the sum of "
                f"each round's client vectors; at most privacy.ddg_max_dropped="
                f"{cfg.ddg_max_dropped} clients of a round drop out or collude with it (in the "
                "simulator the sum is computed in process: the same arithmetic, no "
                "cryptography)"
            ),
        }
        if self.federation is not None:
            out.update(
                {
                    "sigma_per_client": float(self.sigma),
                    "honest_clients": self.honest,
                    "clients_per_round": self.federation.per_round,
                    "gamma": float(self.gamma),
                    "rounding_bound": float(self.bound),
                    "l2_sensitivity": float(self.l2),
                    "l1_sensitivity": float(self.l1),
                    "coords": self.coords,
                    "wrap_probability": self.wrap,
                    "equivalent_noise_multiplier": float(
                        math.sqrt(self.honest) * self.sigma / self.l2
                    ),
                }
            )
        return out

    def releases_left(self, client: str) -> int:
        """How many more releases ``client`` may make within the calibrated budget."""
        return self.rounds - self._released.get(client, 0)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe per-client state (release counters)."""
        return {"released": dict(self._released)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self._released = {str(k): int(v) for k, v in state.get("released", {}).items()}


__all__ = ["DistributedDiscreteGaussian", "Federation", "conditional_round", "discrete_gaussian"]
