"""Configuration of the privacy plug-in (mechanism, budget, clipping, VPP and DCR parameters)."""

from __future__ import annotations

import math
from dataclasses import dataclass

VPP_VARIANTS = ("paper", "normalized", "once", "normalized_once", "history")
RELEASE_SCHEDULES = ("every_round", "once")


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
    # add_remove only: class counts public by assumption, or released with noise and charged
    addremove_counts: str = "public"
    # the reference code's accidental group clipping for IGPP (off: plain clipping, VPDR Eq. 4)
    igpp_group_clip: bool = False
    # where the noise comes from: auto | derived | secret (protofl.privacy.noise)
    noise_seed: str = "auto"
    # releases of prototypes with fewer samples than this are logged as a warning
    warn_min_count: int = 5
    # every_round: a fresh release each round a client takes part (the papers); once: the first
    # release spends the whole budget and is re-sent unchanged afterwards (post-processing)
    release_schedule: str = "every_round"
    # Poisson subsampling of each release (IGPP, add_remove): every example enters a release
    # independently with this probability, drawn from the client's noise key (secret from the
    # server); public counts divide by the fixed q*n.  1: no subsampling (the papers)
    sample_rate: float = 1.0
    # ddg (distributed discrete Gaussian over secure aggregation, protofl.privacy.ddg): the
    # modulus 2^bits of the secure sum, the clients of a round that may drop out or collude with
    # the server (the noise holds with the rest), conditional rounding's beta
    ddg_bits: int = 32
    ddg_max_dropped: int = 0
    ddg_beta: float = math.exp(-0.5)
    # VPP (VPDR Sec. 4.2); paper defaults H=0.1, r=0.1, rho=0.2
    vpp_rho: float = 0.2
    vpp_ratio: float = 0.1
    vpp_score_max: float = 0.1
    vpp_split: str = "joint"
    # paper | normalized | once | normalized_once | history (see docs/privacy.md)
    vpp_variant: str = "paper"
    # ANOVA zeta (VPDR Eq. 8), relative to the median within-class variance
    vpp_zeta: float = 1e-3
    # DCR (VPDR Sec. 4.3)
    dcr_gamma: float = 0.05
    dcr_beta: float = 0.999
    dcr_tau: float = 4.0
    dcr_weight: float = 0.05
    dcr_soft_clip: str = "paper"
    # steps before KD/EMA start (the reference code uses 5, once per run; the paper none)
    dcr_warmup_steps: int = 0

    def __post_init__(self) -> None:
        # the mechanism's name is the registry's to check (protofl.privacy.MECHANISM_REGISTRY,
        # asked by create_mechanism and by preflight before any run starts)
        if not isinstance(self.mechanism, str) or not self.mechanism:
            _fail("mechanism", self.mechanism, "a registered mechanism name")
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            _fail("epsilon", self.epsilon, "(0, inf)")
        if not 0 < self.delta < 1:
            _fail("delta", self.delta, "(0, 1)")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            _fail("clip", self.clip, "(0, inf)")
        if self.accountant not in ("pld", "rdp", "rdp-classic"):
            _fail("accountant", self.accountant, "pld, rdp, rdp-classic")
        if self.neighbouring not in ("replace_one", "add_remove"):
            _fail("neighbouring", self.neighbouring, "replace_one, add_remove")
        if self.addremove_counts not in ("public", "noisy"):
            _fail("addremove_counts", self.addremove_counts, "public, noisy")
        if self.release_schedule not in RELEASE_SCHEDULES:
            _fail("release_schedule", self.release_schedule, ", ".join(RELEASE_SCHEDULES))
        self._check_sampling()
        self._check_ddg()
        if self.noise_seed not in ("auto", "derived", "secret"):
            _fail("noise_seed", self.noise_seed, "auto, derived, secret")
        if isinstance(self.warn_min_count, bool) or not isinstance(self.warn_min_count, int):
            _fail("warn_min_count", self.warn_min_count, "integers >= 0")
        if self.warn_min_count < 0:
            _fail("warn_min_count", self.warn_min_count, "integers >= 0")
        if not 0 < self.vpp_rho <= 0.5:
            _fail("vpp_rho", self.vpp_rho, "(0, 0.5]")
        if not 0 < self.vpp_ratio < 1:
            _fail("vpp_ratio", self.vpp_ratio, "(0, 1)")
        if not self.vpp_score_max > 0:
            _fail("vpp_score_max", self.vpp_score_max, "(0, inf)")
        if self.vpp_split not in ("joint", "paper"):
            _fail("vpp_split", self.vpp_split, "joint, paper")
        if self.vpp_variant not in VPP_VARIANTS:
            _fail("vpp_variant", self.vpp_variant, ", ".join(VPP_VARIANTS))
        if not (self.vpp_zeta > 0 and math.isfinite(self.vpp_zeta)):
            _fail("vpp_zeta", self.vpp_zeta, "(0, inf)")
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
        if isinstance(self.dcr_warmup_steps, bool) or not isinstance(self.dcr_warmup_steps, int):
            _fail("dcr_warmup_steps", self.dcr_warmup_steps, "integers >= 0")
        if self.dcr_warmup_steps < 0:
            _fail("dcr_warmup_steps", self.dcr_warmup_steps, "integers >= 0")

    def _check_sampling(self) -> None:
        q = self.sample_rate
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 < q <= 1:
            _fail("sample_rate", q, "(0, 1]")
        if q == 1 or self.base_mechanism == "none":
            return  # mechanism none releases exact means: there is nothing to subsample
        if self.neighbouring != "add_remove":
            raise ValueError(
                f"privacy.sample_rate={q!r} amplifies privacy under add/remove neighbouring only; "
                "set privacy.neighbouring=add_remove (or privacy.sample_rate=1)"
            )
        if self.base_mechanism != "igpp":
            raise ValueError(
                f"privacy.sample_rate={q!r} is accounted for mechanism igpp only (VPP's private "
                f"subspace selection is not subsampled); privacy.mechanism={self.mechanism!r}"
            )
        if self.accountant == "rdp-classic":
            raise ValueError(
                f"privacy.sample_rate={q!r} needs privacy.accountant pld or rdp (rdp-classic "
                "has no subsampled form)"
            )

    def _check_ddg(self) -> None:
        for key, low, high in (("ddg_bits", 8, 62), ("ddg_max_dropped", 0, 1 << 30)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                _fail(key, v, f"integers in [{low}, {high}]")
        if isinstance(self.ddg_beta, bool) or not 0 < self.ddg_beta < 1:
            _fail("ddg_beta", self.ddg_beta, "(0, 1)")
        if self.mechanism == "ddg" and not self.counts_public:
            raise ValueError(
                "privacy.mechanism=ddg divides the secure sums by public counts; "
                "privacy.addremove_counts=noisy is not supported with it (use public)"
            )

    @property
    def sampled(self) -> bool:
        """Whether releases are Poisson-subsampled (``sample_rate < 1`` on a private release)."""
        return self.sample_rate < 1 and self.base_mechanism != "none"

    @property
    def base_mechanism(self) -> str:
        """The release mechanism (``vpdr`` resolves to ``vpp``)."""
        return "vpp" if self.mechanism == "vpdr" else self.mechanism

    def releases(self, rounds: int) -> int:
        """How many charged releases a client makes in ``rounds`` rounds of taking part: the
        budget is calibrated for this many (``release_schedule: once``: at most one)."""
        return min(rounds, 1) if self.release_schedule == "once" else rounds

    @property
    def counts_public(self) -> bool:
        """Whether exact sample counts are public under the neighbouring relation (all but
        add_remove with noisy counts, where no exact count may leave a client)."""
        return not (
            self.base_mechanism != "none"
            and self.neighbouring == "add_remove"
            and self.addremove_counts == "noisy"
        )

    @property
    def use_dcr(self) -> bool:
        """Whether DCR regularises local training (``vpdr`` turns it on)."""
        return self.dcr or self.mechanism == "vpdr"
