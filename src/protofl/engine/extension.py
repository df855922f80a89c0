"""Extending a finished run (``protofl extend``): what was calibrated, what the added releases
cost, and the run's privacy section afterwards (the simulator's and the Flower engine's)."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from protofl.config import ExperimentConfig
from protofl.engine.rundir import add_extension, record_engine, resume_command, target_rounds
from protofl.engine.secure_sum import uses_secure_sum
from protofl.errors import ConfigError
from protofl.privacy.base import Mechanism

log = logging.getLogger("protofl")


def composed_epsilon(mechanism: Mechanism, config: ExperimentConfig, releases: int) -> float | None:
    """Epsilon at ``privacy.delta`` the accountant composes for ``releases`` releases of one
    client under ``mechanism``'s calibration (None: the mechanism gives no guarantee)."""
    from protofl.privacy.accounting import epsilon_spent

    if not mechanism.is_private or releases < 1:
        return None if not mechanism.is_private else 0.0
    events = [e for i in range(releases) for e in mechanism.release_events(i)]
    return epsilon_spent(events, delta=config.privacy.delta, accountant=config.privacy.accountant)


def raise_release_limit(mechanism: Mechanism, limit: int) -> None:
    """Let each client make ``limit`` releases at the noise ``mechanism`` was calibrated with.

    The mechanism refuses a client's release beyond the rounds it was calibrated for; an
    extension (``protofl extend``, recorded in ``extensions.json``) raises that guard here,
    explicitly and logged, and nowhere else.  The calibration (sigma) does not change, so the
    epsilon spent grows with every extra release (the ledgers compose it).
    """
    if limit < mechanism.rounds:
        raise ValueError(f"release limit {limit} is below the calibrated {mechanism.rounds}")
    if limit > mechanism.rounds:
        log.warning(
            "extension: the %s mechanism's per-client release limit is raised from %d to %d "
            "at the calibrated noise; epsilon spent grows accordingly",
            mechanism.name,
            mechanism.rounds,
            limit,
        )
    mechanism.rounds = limit


def check_extend_rounds(rounds: object) -> int:
    """The number of rounds to extend by: an integer >= 1, or a one-line error."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"--rounds={rounds!r}: extend by a whole number of rounds >= 1")
    return rounds


def plan_extension(run_dir: Path, config: ExperimentConfig, rounds: int) -> dict[str, Any]:
    """Check that ``run_dir`` finished and write its extension by ``rounds`` to
    ``extensions.json`` (what was calibrated, what is added, the new total epsilon)."""
    from protofl.engine.checkpoint import latest_checkpoint_round
    from protofl.privacy import create_mechanism

    rounds = check_extend_rounds(rounds)
    done = target_rounds(run_dir, config)
    reached = latest_checkpoint_round(run_dir)
    if not (run_dir / "summary.json").exists() or reached is None or reached < done:
        if reached is None and not config.federation.checkpoint:
            raise ConfigError(
                f"{run_dir}: the run kept no checkpoint (federation.checkpoint=false), so there is "
                "no final state to extend; start a new run with more rounds"
            )
        raise ConfigError(
            f"{run_dir}: the run has not finished (round {reached or 0} of {done}); finish it "
            f"first with `{resume_command(run_dir)}`, then extend it"
        )
    fed, priv = config.federation, config.privacy
    calibrated = priv.releases(fed.rounds)
    mechanism = create_mechanism(priv, rounds=calibrated, dim=config.backbone.proto_dim)
    if uses_secure_sum(mechanism):  # ddg: calibrated for the run's federation, as recorded
        summary = json.loads((run_dir / "summary.json").read_text())
        mechanism.restore_calibration(summary.get("privacy", {}))  # type: ignore[attr-defined]
    # charged releases: privacy.release_schedule=once re-sends its one release, adding none
    before = composed_epsilon(mechanism, config, priv.releases(done))
    after = composed_epsilon(mechanism, config, priv.releases(done + rounds))
    entry = {
        "rounds": rounds,
        "from_round": done,
        "to_round": done + rounds,
        "engine": record_engine(run_dir),
        "created": datetime.now().isoformat(timespec="seconds"),
        "calibrated": {
            "mechanism": mechanism.name,
            "epsilon": priv.epsilon if mechanism.is_private else None,
            "delta": priv.delta if mechanism.is_private else None,
            "rounds": calibrated,
            "accountant": priv.accountant,
            "release_schedule": priv.release_schedule,
        },
        "epsilon_before": before,
        "epsilon_after": after,
        "note": (
            "privacy.release_schedule=once: the extension re-sends each client's one release; "
            f"the epsilon stays {after:.4g} at delta {priv.delta:g}"
            if after is not None and priv.release_schedule == "once"
            else f"the noise was calibrated for ({priv.epsilon:g}, {priv.delta:g}) over "
            f"{fed.rounds} releases per client; {done + rounds} releases at that noise compose "
            f"to epsilon {after:.4g} at delta {priv.delta:g} ({priv.accountant}): the original "
            "epsilon no longer holds"
            if after is not None
            else "no privacy guarantee (the mechanism adds none)"
        ),
    }
    add_extension(run_dir, entry)
    return entry


def extended_privacy(privacy: dict[str, Any], extensions: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's privacy section of an extended run: the epsilon and guarantee are the
    accountant's for every release made, and the calibrated budget is stated beside them."""
    if not extensions:
        return privacy
    last = extensions[-1]
    target, total = int(last["to_round"]), last["epsilon_after"]
    cal = last["calibrated"]
    out = dict(privacy)
    out["rounds"] = target
    out["calibrated"] = cal
    out["extensions"] = [
        {k: e[k] for k in ("from_round", "to_round", "rounds", "epsilon_after", "created")}
        for e in extensions
    ]
    old = out.get("guarantee")
    if cal.get("release_schedule") == "once":  # no release was added: the guarantee stands
        return out
    if isinstance(old, dict) and old.get("epsilon") is not None and total is not None:
        out["epsilon"] = total
        new = dict(old)
        new["epsilon"], new["rounds"] = total, target
        kind = "distributed DP (secure sums)" if cal.get("mechanism") == "ddg" else "local DP"
        claimed = (
            f"({cal['epsilon']:g}, {cal['delta']:g})-{kind} per client over the whole run "
            f"({cal['rounds']} releases)"
        )
        holds = (
            f"({total:g}, {cal['delta']:g})-{kind} per client over the whole run "
            f"({target} releases)"
        )
        statement = str(old.get("statement", ""))
        rest = statement[len(claimed) :] if statement.startswith(claimed) else ""
        new["statement"] = (
            holds
            + rest
            + f"; EXTENDED: the noise was calibrated for ({cal['epsilon']:g}, {cal['delta']:g}) "
            f"over {cal['rounds']} releases; {target - int(cal['rounds'])} more releases at the "
            "same noise raised epsilon to the value stated"
        )
        new["calibrated_epsilon"] = cal["epsilon"]
        out["guarantee"] = new
    return out


__all__ = [
    "check_extend_rounds",
    "composed_epsilon",
    "extended_privacy",
    "plan_extension",
    "raise_release_limit",
]
