"""The empirical audit against the shipped mechanisms and four deliberate bugs (docs/attacks.md).

    python experiments/audit_bugs.py            # defaults: 20 rounds, 100k + 2k trials, 99%

Each bug's true epsilon at a claimed 1 is computed from its actual noise (PLD composition); the
audit must flag every bug and no shipped mechanism.  Prints a markdown table.
"""

from __future__ import annotations

import sys
import time

from protofl.attacks.audit import audit_mechanism
from protofl.attacks.broken import (
    AddsHalfTheStatedNoise,
    Eq19Broken,
    HalfNoise,
    NoiseTimes07,
    true_run_epsilon,
)
from protofl.privacy import PrivacyConfig
from protofl.privacy.mechanisms import IGPP, VPP

ROUNDS = 20


def true_epsilon(cls: type[IGPP] | type[VPP], epsilon: float) -> float:
    mech = cls(PrivacyConfig(mechanism=cls.name, epsilon=epsilon, clip=1.0), rounds=ROUNDS, dim=32)
    return true_run_epsilon(mech, ROUNDS)


def main() -> int:
    cases: list[tuple[str, object, float]] = [
        ("igpp", "igpp", 1.0),
        ("igpp", "igpp", 4.0),
        ("vpp", "vpp", 1.0),
        ("vpp", "vpp", 4.0),
        ("bug: noise x 0.5", HalfNoise, 1.0),
        ("bug: noise x 0.7", NoiseTimes07, 1.0),
        ("bug: adds half the stated noise", AddsHalfTheStatedNoise, 1.0),
        ("bug: VPP Eq. (19) broken", Eq19Broken, 1.0),
    ]
    print(
        "| mechanism | claimed eps (run) | true eps | lower bound (99%) | fast / release bound "
        "| trials (fast + release) | flagged | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for label, mech, eps in cases:
        t0 = time.perf_counter()
        out = audit_mechanism(mech, eps, rounds=ROUNDS)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        true = eps if isinstance(mech, str) else true_epsilon(mech, eps)  # type: ignore[arg-type]
        should = not isinstance(mech, str)
        ok &= out["violation"] is should
        m = out["modes"]
        print(
            f"| {label} | {out['epsilon_claimed']:.3f} | {true:.2f} | "
            f"{out['epsilon_lower_bound']:.3f} | {m['fast']['epsilon_lower_bound']:.3f} / "
            f"{m['release']['epsilon_lower_bound']:.3f} | {out['trials']} + "
            f"{out['release_trials']} | {'yes' if out['violation'] else 'no'} | {wall:.0f} |",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
