"""The empirical audit against the shipped mechanisms, five deliberate bugs and a correct Laplace
mechanism (docs/attacks.md).

    python experiments/audit_bugs.py                 # the CLI's defaults: release mode,
                                                     # 20 rounds, 64,000 trials, 99%
    python experiments/audit_bugs.py --mode fast     # the simulated mode instead

Each bug's true epsilon at a claimed 1 is computed from its actual noise (PLD composition); the
audit must flag every bug (fast mode: all but the two that state more noise than they add) and
no correct mechanism; the exit code says whether it did.  Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from protofl.attacks.audit import TRIALS, audit_mechanism, scaled_noise
from protofl.attacks.broken import (
    AddsHalfTheStatedNoise,
    Eq19Broken,
    HalfNoise,
    LaplaceReference,
    NoiseTimes07,
    StatesMoreThanItAdds,
    laplace_claim,
    true_run_epsilon,
)
from protofl.privacy import PrivacyConfig
from protofl.privacy.base import MECHANISM_REGISTRY

ROUNDS = 20


def true_epsilon(mech: Any, epsilon: float, noise_scale: float) -> float:
    """The run's true epsilon at 1e-5 from the noise it adds."""
    cls = MECHANISM_REGISTRY.get(mech) if isinstance(mech, str) else mech
    cls = scaled_noise(cls, noise_scale)
    obj = cls(PrivacyConfig(mechanism=cls.name, epsilon=epsilon), rounds=ROUNDS, dim=32)
    return true_run_epsilon(obj, ROUNDS)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("release", "fast"), default="release")
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # (label, mechanism, epsilon, options, a bug, a bug only the release mode can see)
    cases: list[tuple[str, Any, float, dict[str, Any], bool, bool]] = [
        ("igpp", "igpp", 1.0, {}, False, False),
        ("igpp", "igpp", 4.0, {}, False, False),
        ("vpp", "vpp", 1.0, {}, False, False),
        ("vpp", "vpp", 4.0, {}, False, False),
        ("Laplace, pure 1-DP (its own claim)", LaplaceReference, 1.0, {}, False, False),
        ("igpp --noise-scale 0.8", "igpp", 1.0, {"noise_scale": 0.8}, True, False),
        ("bug: noise x 0.5", HalfNoise, 1.0, {}, True, False),
        ("bug: noise x 0.7", NoiseTimes07, 1.0, {}, True, False),
        ("bug: adds half the stated noise", AddsHalfTheStatedNoise, 1.0, {}, True, True),
        ("bug: adds 0.8 x the stated noise", StatesMoreThanItAdds, 1.0, {}, True, True),
        ("bug: VPP Eq. (19) broken", Eq19Broken, 1.0, {}, True, False),
    ]
    print(
        "| mechanism | claimed eps (run) | true eps | accuracy: claimed max / measured / "
        "lower bound (99%) | mu: claimed / lower bound | eps at delta lower bound | "
        "GDP estimate (not used) | flagged | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for label, mech, eps, extra, bug, release_only in cases:
        if mech is LaplaceReference and args.mode == "fast":
            continue  # fast mode simulates Gaussian noise: refused for a Laplace mechanism
        should = bug and not (release_only and args.mode == "fast")
        kwargs: dict[str, Any] = {"mode": args.mode, "trials": args.trials, "seed": args.seed}
        kwargs.update(extra)
        if mech is LaplaceReference:
            kwargs["claim"] = laplace_claim(eps, ROUNDS)
        t0 = time.perf_counter()
        out = audit_mechanism(mech, eps, rounds=ROUNDS, **kwargs)
        wall = time.perf_counter() - t0
        if mech is LaplaceReference:  # at most its (valid) claim
            true = f"<= {out['epsilon_claimed']:.2f}"
        else:
            true = f"{true_epsilon(mech, eps, float(extra.get('noise_scale', 1.0))):.2f}"
        ok &= out["violation"] is should
        res = out["modes"][args.mode]
        print(
            f"| {label} | {out['epsilon_claimed']:.3f} | {true} | "
            f"{out['accuracy_claimed_max']:.4f} / {res['accuracy']:.4f} / "
            f"{res['accuracy_lower_bound']:.4f} | {out['mu_claimed']:.3f} / "
            f"{res['mu_lower_bound']:.3f} | {res['epsilon_lower_bound']:.3f} | "
            f"{res['gdp_estimate']['epsilon_lower_bound']:.3f} | "
            f"{'yes' if out['violation'] else 'no'} | {wall:.0f} |",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
