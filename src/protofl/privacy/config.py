"""Configuration of the privacy plug-in (mechanism, budget, clipping, VPP and DCR parameters)."""

from __future__ import annotations

from dataclasses import dataclass

MECHANISMS = ("none", "igpp", "vpp", "vpdr")


def _fail(key: str, value: object, allowed: str) -> None:
    raise ValueError(f"privacy.{key}={value!r} is out of range; allowed: {allowed}")


@dataclass(frozen=True)
class PrivacyConfig:
    """Privacy settings; ``mechanism: vpdr`` is shorthand for ``vpp`` with ``dcr: true``."""

    mechanism: str = "none"
    dcr: bool = False
    epsilon: float = 1.0
    delta: float = 1e-5
    clip: float = 5.0
    accountant: str = "pld"
    neighbouring: str = "replace_one"
    # VPP (VPDR Sec. 4.2); paper defaults H=0.1, r=0.1, rho=0.2
    vpp_rho: float = 0.2
    vpp_ratio: float = 0.1
    vpp_score_max: float = 0.1
    vpp_split: str = "joint"
    # DCR (VPDR Sec. 4.3)
    dcr_gamma: float = 0.05
    dcr_beta: float = 0.999
    dcr_tau: float = 4.0
    dcr_weight: float = 0.05
    dcr_soft_clip: str = "paper"

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(
                f"privacy.mechanism={self.mechanism!r} is unknown; choose one of: "
                + ", ".join(MECHANISMS)
            )
        if not self.epsilon > 0:
            _fail("epsilon", self.epsilon, "(0, inf)")
        if not 0 < self.delta < 1:
            _fail("delta", self.delta, "(0, 1)")
        if not self.clip > 0:
            _fail("clip", self.clip, "(0, inf)")
        if self.accountant not in ("pld", "rdp", "rdp-classic"):
            _fail("accountant", self.accountant, "pld, rdp, rdp-classic")
        if self.neighbouring not in ("replace_one", "add_remove"):
            _fail("neighbouring", self.neighbouring, "replace_one, add_remove")
        if not 0 < self.vpp_rho <= 0.5:
            _fail("vpp_rho", self.vpp_rho, "(0, 0.5]")
        if not 0 < self.vpp_ratio < 1:
            _fail("vpp_ratio", self.vpp_ratio, "(0, 1)")
        if not self.vpp_score_max > 0:
            _fail("vpp_score_max", self.vpp_score_max, "(0, inf)")
        if self.vpp_split not in ("joint", "paper"):
            _fail("vpp_split", self.vpp_split, "joint, paper")
        if not self.dcr_gamma > 0:
            _fail("dcr_gamma", self.dcr_gamma, "(0, inf)")
        if not 0 <= self.dcr_beta < 1:
            _fail("dcr_beta", self.dcr_beta, "[0, 1)")
        if not self.dcr_tau > 0:
            _fail("dcr_tau", self.dcr_tau, "(0, inf)")
        if not self.dcr_weight >= 0:
            _fail("dcr_weight", self.dcr_weight, "[0, inf)")
        if self.dcr_soft_clip not in ("paper", "min"):
            _fail("dcr_soft_clip", self.dcr_soft_clip, "paper, min")

    @property
    def base_mechanism(self) -> str:
        """The release mechanism (``vpdr`` resolves to ``vpp``)."""
        return "vpp" if self.mechanism == "vpdr" else self.mechanism

    @property
    def use_dcr(self) -> bool:
        """Whether DCR regularises local training (``vpdr`` turns it on)."""
        return self.dcr or self.mechanism == "vpdr"
