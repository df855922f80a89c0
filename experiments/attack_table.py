"""Attack every run of a sweep (MIA, then FSH) and print the attack table, mean ± std over seeds.

    python experiments/attack_table.py SWEEP_DIR [--steps 300] [--samples 2] [--fsh-per-row N]
                                                 [--no-attack]

Runs already attacked (``attack_mia.json`` / ``attack_fsh.json`` present) are not attacked
again, so the script resumes.  Rows: (mechanism, epsilon) from each run's config.yaml; columns:
the run's headline AVG accuracy and the mean-over-clients attack metrics of its last round's
releases (distance MIA AUC, TPR at 1% FPR, advantage; the likelihood-ratio ``cal`` AUC; FSH
cosine to the target prototype and Top-1 hit on the true class means).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

COLUMNS = [
    ("AVG acc", "acc"),
    ("MIA AUC", "mia_auc"),
    ("TPR@1%FPR", "mia_tpr_at_1fpr"),
    ("advantage", "mia_advantage"),
    ("cal AUC", "mia_cal_auc"),
    ("FSH cos", "cos_sim"),
    ("Top-1 hit %", "top1_hit"),
]


def attack(run: Path, steps: int, samples: int, fsh: bool) -> None:
    from protofl.attacks.fsh import fsh_on_run
    from protofl.attacks.mia import mia_on_run

    if not (run / "attack_mia.json").exists():
        mia_on_run(run)
    if fsh and not (run / "attack_fsh.json").exists():
        fsh_on_run(run, max_steps=steps, samples_per_target=samples)


def metrics(run: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    summary = json.loads((run / "summary.json").read_text())
    acc = summary.get("avg_acc")  # the final round (VPDR's rule)
    if isinstance(acc, int | float):
        out["acc"] = 100.0 * float(acc)
    for kind in ("mia", "fsh"):
        path = run / f"attack_{kind}.json"
        if path.exists():
            for key, value in (json.loads(path.read_text()).get("mean") or {}).items():
                if isinstance(value, int | float) and math.isfinite(value):
                    out[key] = float(value)
    return out


def cell(values: list[float], scale: float, digits: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--steps", type=int, default=300, help="FSH Adam steps (default 300)")
    ap.add_argument("--samples", type=int, default=2, help="FSH reconstructions per class")
    ap.add_argument(
        "--fsh-per-row",
        type=int,
        default=None,
        help="FSH on only the first N runs (lowest seeds) of each row (default: every run)",
    )
    ap.add_argument("--no-attack", action="store_true", help="only read existing results")
    args = ap.parse_args(argv)
    runs = sorted(p.parent for p in args.sweep_dir.glob("*/summary.json"))
    if not runs:
        print(f"{args.sweep_dir}: no finished run (no */summary.json)", file=sys.stderr)
        return 2
    rows: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    configs = {run: yaml.safe_load((run / "config.yaml").read_text()) for run in runs}
    runs.sort(key=lambda r: configs[r]["seed"])  # --fsh-per-row takes the lowest seeds
    for run in runs:
        config = configs[run]
        mech = config["privacy"]["mechanism"]
        eps = "-" if mech == "none" else f"{config['privacy']['epsilon']:g}"
        if not args.no_attack:
            print(f"attacking {run.name}", file=sys.stderr)
            fsh = args.fsh_per_row is None or len(rows[(mech, eps)]) < args.fsh_per_row
            attack(run, args.steps, args.samples, fsh)
        rows[(mech, eps)].append(metrics(run))
    head = ["mechanism", "ε", "n (MIA / FSH)"] + [name for name, _ in COLUMNS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (mech, eps), group in rows.items():
        n_fsh = sum("top1_hit" in m for m in group)
        cells = [mech, eps, f"{len(group)} / {n_fsh}"]
        for _name, key in COLUMNS:
            values = [m[key] for m in group if key in m]
            percent = key in ("acc", "top1_hit")  # percentages: 2 digits; the rest 3
            cells.append(cell(values, 100.0 if key == "top1_hit" else 1.0, 2 if percent else 3))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
