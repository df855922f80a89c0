"""What a selection costs in privacy: every validation and test run releases the same
clients' data, so their DP events compose per client; the choice itself is not covered."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from protofl.config import ExperimentConfig
from protofl.sweeps.plan import SELECT_DIR, SELECTION_FILE, SweepPlan, SweepPoint, _show
from protofl.sweeps.status import _read_summary

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# what a selection costs in privacy
# --------------------------------------------------------------------------------------------
VALIDATION_GAP = (
    "validation accuracy: every validation run evaluates on a held-out part of the clients' "
    "training data (data.validation_fraction) and reports the accuracy without noise (its "
    "metrics.jsonl and summary.json, selection.json); for these runs evaluation is not outside "
    "the guarantee's scope but private training data released outside any mechanism"
)
TUNING_GAP = (
    "tuning (argmax over private validation accuracy): the chosen value is a data-dependent "
    "choice made from those accuracies without a mechanism, and the test runs make their "
    "releases at it; composing the runs' releases does not charge the choice"
)
SELECTION_COMPOSES = (
    "per client, the DP events of every run of the selection in one ledger: every validation "
    "run (every candidate value, every seed) and every test run. The validation split is carved "
    "out of each client's training data and the test runs train on all of it, and the seeds "
    "draw their splits, partitions and noise from the same data set, so one example is in some "
    "client's training data in every run and every run releases it. Each run is charged the "
    "releases of its client with the most releases (every client makes one a round under full "
    "participation), counted from metrics.jsonl, each costing the events the run's mechanism "
    "charges for it (Mechanism.release_events, what a server charges), checked against the "
    "epsilon every client's ledger recorded in summary.json"
)


def _run_cost(label: str, config: ExperimentConfig, run_dir: Path) -> dict[str, Any]:
    """What one run of a selection released: the releases of its most-releasing client (counted
    from the ``participants`` of its ``metrics.jsonl`` rows), whether it has a guarantee, the
    epsilon it states and what that leaves out (its ``summary.json``), and an ``error`` when the
    epsilon its ledgers recorded is not what the counted releases compose to."""
    from protofl.privacy.accounting import epsilon_spent

    rows: dict[int, dict[str, Any]] = {}
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed run
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            rows[row["round"]] = row  # a resumed round's row replaces the first one
    counts: dict[str, int] = {}
    private = True
    for row in rows.values():
        spent = (row.get("privacy") or {}).get("epsilon_spent")
        if not isinstance(spent, Mapping) or any(v is None for v in spent.values()):
            private = False  # mechanism none, or no prototype release (weights only)
        names = row.get("participants")
        if not isinstance(names, list):
            names = list(spent) if isinstance(spent, Mapping) else []
        for name in names:
            counts[str(name)] = counts.get(str(name), 0) + 1
    summary = _read_summary(run_dir)
    finished = summary is not None and "avg_acc" in summary
    cost: dict[str, Any] = {
        "run": label,
        # charged releases (privacy.release_schedule=once: at most one, re-sent after)
        "releases": config.privacy.releases(max(counts.values(), default=0)),
        "epsilon": None,
        "finished": finished,
    }
    mechanism = _selection_mechanism(config)
    if not mechanism.is_private:
        private = False
    not_covered: list[str] = []
    outside: list[str] = []
    if summary is not None:
        privacy = summary.get("privacy") if isinstance(summary.get("privacy"), Mapping) else {}
        guarantee = privacy.get("guarantee") if isinstance(privacy, Mapping) else None
        guarantee = guarantee if isinstance(guarantee, Mapping) else {}
        if guarantee.get("epsilon") is None:
            private = False
        cost["epsilon"] = guarantee.get("epsilon")
        not_covered = [str(g) for g in guarantee.get("not_covered", [])]
        outside = [str(g) for g in guarantee.get("outside_scope", [])]
        recorded = privacy.get("epsilon_spent") if isinstance(privacy, Mapping) else None
        if private and isinstance(recorded, Mapping):
            composed: dict[int, float] = {}
            for client, eps in recorded.items():
                n = config.privacy.releases(counts.get(str(client), 0))
                if n not in composed:
                    events = [e for i in range(n) for e in mechanism.release_events(i)]
                    composed[n] = epsilon_spent(
                        events, delta=config.privacy.delta, accountant=config.privacy.accountant
                    )
                if eps is None or not math.isclose(composed[n], eps, rel_tol=1e-9, abs_tol=1e-12):
                    cost["error"] = (
                        f"{label}: {n} releases of client {client} compose to epsilon "
                        f"{composed[n]:.6g}, its ledger recorded {eps}"
                    )
                    break
    cost["private"] = private
    cost["not_covered"] = not_covered
    cost["outside_scope"] = outside
    return cost


_MECHANISMS: dict[str, Any] = {}
RunRef = tuple[str, ExperimentConfig, Path]
"""A run of a selection: its label in ``selection.json``, its config and its folder."""


def _selection_mechanism(config: ExperimentConfig) -> Any:
    """The run's mechanism as its server creates it (cached: calibrations repeat in a sweep)."""
    from protofl.privacy import create_mechanism

    fed = config.federation
    key = repr((config.privacy, fed.rounds, config.backbone.proto_dim))
    if key not in _MECHANISMS:
        _MECHANISMS[key] = create_mechanism(
            config.privacy,
            rounds=config.privacy.releases(fed.rounds),
            dim=config.backbone.proto_dim,
        )
    return _MECHANISMS[key]


def selection_privacy(
    runs: Sequence[RunRef],
    *,
    costs: Mapping[str, dict[str, Any]] | None = None,
    per_run: bool = True,
) -> dict[str, Any]:
    """The privacy cost of the selection runs ``(label, config, run folder)``, per client: their
    DP events composed in one :class:`~protofl.privacy.ledger.PrivacyLedger` (see
    :data:`SELECTION_COMPOSES`), at the smallest delta of the runs, with their accountant (pld
    when they differ).  It never covers the selection itself (:data:`TUNING_GAP`), so
    ``complete`` is false; ``epsilon`` is None when a run has no guarantee or its ledger does not
    match.  ``costs``: :func:`_run_cost` by label, where already computed."""
    from protofl.privacy.ledger import PrivacyLedger

    configs = [c for _, c, _ in runs]
    delta = min((c.privacy.delta for c in configs), default=1e-5)
    accountants = {c.privacy.accountant for c in configs}
    accountant = accountants.pop() if len(accountants) == 1 else "pld"
    ledger = PrivacyLedger(delta=delta, accountant=accountant)
    found: list[dict[str, Any]] = []
    for label, config, run_dir in runs:
        cost = (costs or {}).get(label) or _run_cost(label, config, run_dir)
        found.append(cost)
        mechanism = _selection_mechanism(config)
        for i in range(cost["releases"]):
            ledger.charge(i, mechanism.name, mechanism.release_events(i))
    gaps = [VALIDATION_GAP, TUNING_GAP]
    outside: list[str] = []
    for cost in found:
        gaps += [g for g in cost["not_covered"] if g not in gaps]
        outside += [g for g in cost["outside_scope"] if g not in outside]
    errors = [c["error"] for c in found if "error" in c]
    unguarded = [c["run"] for c in found if not c["private"]]
    stated = [c["epsilon"] for c in found if c["epsilon"] is not None]
    releases = sum(c["releases"] for c in found)
    out: dict[str, Any] = {
        "epsilon": None,
        "delta": delta,
        "accountant": accountant,
        "runs": len(found),
        "releases": releases,
        "run_epsilon": max(stated) if stated else None,
        "composes": SELECTION_COMPOSES,
        "unfinished": [c["run"] for c in found if not c["finished"]],
        "complete": False,
        "holds_against_server": False,
        "not_covered": gaps,
        "outside_scope": outside,
    }
    if per_run:
        out["per_run"] = [
            {k: c[k] for k in ("run", "releases", "epsilon", "finished")} for c in found
        ]
    short = "; ".join(g.split(":")[0] for g in gaps)
    if errors:
        out["error"] = "; ".join(errors)
        out["statement"] = f"no composed guarantee: {out['error']}"
    elif unguarded:
        out["statement"] = (
            "no privacy guarantee for the selection: "
            + ", ".join(unguarded[:3])
            + (f" and {len(unguarded) - 3} more" if len(unguarded) > 3 else "")
            + " released without one"
        )
    else:
        epsilon = ledger.epsilon_spent()
        out["epsilon"] = epsilon
        each = (
            ""
            if out["run_epsilon"] is None
            else f"; the epsilon {out['run_epsilon']:g} each run states holds for that run alone"
        )
        out["statement"] = (
            f"the selection's releases compose to ({epsilon:.4g}, {delta:g})-local DP per "
            f"client over {len(found)} runs ({releases} releases, {accountant}){each}; "
            f"NOT covered: {short}"
        )
    return out


def _record_privacy(
    record: dict[str, Any],
    plan: SweepPlan,
    tpoints: Sequence[SweepPoint],
    sweep_dir: Path,
) -> None:
    """Add each group's privacy cost and the whole selection's to ``record`` (see
    :func:`selection_privacy`) and state it in every run's ``summary.json``
    (``privacy.selection``): a run's own guarantee covers its releases only."""
    sel = plan.select
    assert sel is not None

    def member(overrides: Mapping[str, Any], group: Mapping[str, Any]) -> bool:
        return all(_show(overrides.get(k)) == _show(v) for k, v in group.items())

    everything: list[RunRef] = []
    costs: dict[str, dict[str, Any]] = {}
    labelled: list[tuple[dict[str, Any], list[RunRef], list[RunRef]]] = []
    for entry in record["groups"]:
        indices = {p.index for p in plan.points if member(p.overrides, entry["group"])}
        vruns = [
            (
                f"{SELECT_DIR}/{v.point.dirname}",
                v.point.config,
                sweep_dir / SELECT_DIR / v.point.dirname,
            )
            for v in plan.validation
            if v.grid_index in indices
        ]
        truns = (
            [
                (p.dirname, p.config, sweep_dir / p.dirname)
                for p in tpoints
                if member(p.overrides, entry["group"])
            ]
            if entry["chosen"] is not None
            else []
        )
        for label, config, run_dir in vruns + truns:
            costs[label] = _run_cost(label, config, run_dir)
        entry["privacy"] = selection_privacy(vruns + truns, costs=costs)
        everything += vruns + truns
        labelled.append((entry, vruns, truns))
    record["privacy"] = selection_privacy(everything, costs=costs, per_run=False)
    for entry, vruns, truns in labelled:
        total = entry["privacy"]
        common = {
            "key": sel.key,
            "selection_file": f"{SELECTION_FILE} in the sweep folder",
            "group": entry["group"],
            "epsilon": total["epsilon"],
            "delta": total["delta"],
            "complete": False,
            "not_covered": total["not_covered"],
        }
        for _, config, run_dir in vruns:
            _note_selection(
                run_dir,
                {
                    "role": "validation",
                    "value": _get_dotted(config, sel.key),
                    **common,
                    "statement": (
                        f"validation run of a selection of {sel.key}: this run's guarantee "
                        "covers its own releases only; its accuracy is computed on private "
                        "training data, not on a test split, and is NOT covered; the whole "
                        f"group: {total['statement']}"
                    ),
                },
            )
        for _, _, run_dir in truns:
            _note_selection(
                run_dir,
                {
                    "role": "test",
                    "value": entry["chosen"],
                    **common,
                    "statement": (
                        f"{sel.key}={_show(entry['chosen'])} was chosen on validation runs of the "
                        "same clients' training data: this run's guarantee covers its own "
                        f"releases only, not the selection; {total['statement']}"
                    ),
                },
            )


def _get_dotted(config: ExperimentConfig, key: str) -> Any:
    value: Any = config.to_dict()
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _note_selection(run_dir: Path, note: dict[str, Any]) -> None:
    """Put ``note`` into ``run_dir/summary.json`` as ``privacy.selection`` (finished runs)."""
    from protofl.data.cache import atomic_write_bytes

    summary = _read_summary(run_dir)
    if summary is None or not isinstance(summary.get("privacy"), dict):
        return
    note = json.loads(json.dumps(note, default=str))
    if summary["privacy"].get("selection") == note:
        return
    summary["privacy"]["selection"] = note
    atomic_write_bytes(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
