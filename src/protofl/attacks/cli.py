"""``protofl attack RUN_DIR --attack mia|fsh`` and ``protofl audit --mechanism igpp|vpp ...``.

Wire into the top-level parser with ``add_attack_parsers(subparsers)``; each parsed namespace has
``func`` set to a handler returning the exit code.  Bad input raises ``ValueError`` or
``FileNotFoundError`` (the top-level ``main`` turns them into one line and exit code 2).
Standalone: ``python -m protofl.attacks.cli attack RUN_DIR --attack mia``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from protofl.privacy.base import private_mechanisms, sum_mechanisms

# the audit's defaults (protofl.attacks.audit, imported only when the audit runs)
AUDIT_TRIALS = 64_000
AUDIT_CANARIES = 64
AUDIT_MODES = ("release", "fast", "both")
AUDIT_CLAIMS = ("profile", "point")

MIA_COLUMNS = (
    ("mia_auc", "AUC"),
    ("mia_tpr_at_1fpr", "TPR@1%FPR"),
    ("mia_advantage", "adv"),
    ("mia_f1", "F1"),
    ("mia_pc_auc", "pc AUC"),
    ("mia_pc_tpr_at_1fpr", "pc TPR@1%"),
    ("mia_pc_advantage", "pc adv"),
    ("mia_cal_auc", "cal AUC"),
    ("mia_cal_tpr_at_1fpr", "cal TPR@1%"),
    ("mia_cal_advantage", "cal adv"),
    ("mia_members", "members"),
    ("mia_nonmembers", "non-members"),
)
FSH_COLUMNS = (
    ("cos_sim", "cos sim"),
    ("cffd", "cFFD (diag)"),
    ("top1_hit", "top-1 hit"),
    ("top1_hit_released", "hit (released)"),
    ("steps", "steps"),
)


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 or value.is_integer() else f"{value:.4f}"
    return str(value)


def _print_table(
    title: str, rows: dict[str, dict[str, Any]], columns: Sequence[tuple[str, str]]
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("client")
    for _, head in columns:
        table.add_column(head, justify="right")
    for name, metrics in rows.items():
        table.add_row(name, *(_fmt(metrics.get(key)) for key, _ in columns))
    Console(width=200).print(table)


def _cmd_attack(args: argparse.Namespace) -> int:
    from protofl.attacks.artifacts import json_safe

    clients = [args.client] if args.client else None
    if args.round is not None and args.round < 1:
        raise ValueError(f"--round={args.round} is out of range; allowed: integers >= 1")
    from protofl.progress import progress_notes, step

    with progress_notes(True), step(f"{args.attack} attack on {args.run_dir}"):
        result, columns, out_file = _attack(args, clients)
    if args.json:
        print(json.dumps(json_safe(result), indent=2))
        return 0
    return _print_attack(args, result, columns, out_file)


def _attack(
    args: argparse.Namespace, clients: list[str] | None
) -> tuple[dict[str, Any], Sequence[tuple[str, str]], str]:
    if args.attack == "mia":
        from protofl.attacks.mia import mia_on_run

        result = mia_on_run(
            args.run_dir,
            round_=args.round,
            clients=clients,
            max_per_class=args.max_per_class,
            seed=args.seed,
            device=args.device,
        )
        columns: Sequence[tuple[str, str]] = MIA_COLUMNS
        out_file = "attack_mia.json"
    else:
        from protofl.attacks.fsh import fsh_on_run

        result = fsh_on_run(
            args.run_dir,
            round_=args.round,
            clients=clients,
            samples_per_target=args.samples,
            max_steps=args.steps,
            patience=args.patience,
            seed=args.seed,
            device=args.device,
        )
        columns = FSH_COLUMNS
        out_file = "attack_fsh.json"
    return result, columns, out_file


def _print_attack(
    args: argparse.Namespace,
    result: dict[str, Any],
    columns: Sequence[tuple[str, str]],
    out_file: str,
) -> int:
    eps = "no privacy" if result["epsilon"] is None else f"epsilon={result['epsilon']:g}"
    title = (
        f"{args.attack.upper()} on {result['method']} / {result['mechanism']} ({eps}), "
        f"round {result['round']} of {result['rounds']}"
    )
    _print_table(title, {**result["clients"], "mean": result["mean"]}, columns)
    print(f"written: {result['run_dir']}/{out_file}")
    for name in result.get("images", {}).values():
        print(f"image:   {result['run_dir']}/{name}")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from protofl.attacks.audit import audit_mechanism
    from protofl.progress import progress_notes

    with progress_notes(True), _ticker("audit", args.mode):
        if args.mechanism in sum_mechanisms():
            result = _audit_sum(args)
        else:
            result = _audit(args, audit_mechanism)
    return _print_audit(args, result)


@contextlib.contextmanager
def _ticker(what: str, mode: str, every: float = 5.0) -> Iterator[None]:
    """A line on stderr every ``every`` seconds while a long step runs (the audit's release
    mode runs for tens of seconds after its first line)."""
    from protofl.progress import note

    done = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        while not done.wait(every):
            note(f"{what}, {mode} mode: still running, {time.perf_counter() - t0:.0f} s")

    thread = threading.Thread(target=tick, name=f"protofl-{what}-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _audit_sum(args: argparse.Namespace) -> dict[str, Any]:
    from protofl.attacks.audit_sum import audit_secure_sum

    if args.mode != "release" or args.sample_rate != 1.0 or args.claim != "profile":
        raise ValueError(
            f"--mechanism {args.mechanism} is audited from the decoded sum only: drop --mode, "
            "--sample-rate and --claim (its claim is the ledger's epsilon with the KL bound)"
        )
    return audit_secure_sum(  # type: ignore[no-any-return]
        args.epsilon,
        delta=args.delta,
        trials=args.trials,
        rounds=args.rounds,
        clients=args.clients,
        dim=args.dim,
        canaries=args.canaries,
        confidence=args.confidence,
        noise_scale=args.noise_scale,
        neighbouring=args.neighbouring,
        seed=args.seed,
    )


def _audit(args: argparse.Namespace, audit_mechanism: Any) -> dict[str, Any]:
    return audit_mechanism(  # type: ignore[no-any-return]
        args.mechanism,
        args.epsilon,
        delta=args.delta,
        trials=args.trials,
        release_trials=args.release_trials,
        mode=args.mode,
        rounds=args.rounds,
        confidence=args.confidence,
        noise_scale=args.noise_scale,
        dim=args.dim,
        canaries=args.canaries,
        claim=args.claim,
        seed=args.seed,
        neighbouring=args.neighbouring,
        sample_rate=args.sample_rate,
    )


def _print_audit(args: argparse.Namespace, result: dict[str, Any]) -> int:
    if args.json:
        from protofl.attacks.artifacts import json_safe

        print(json.dumps(json_safe(result), indent=2))
        return 1 if result["violation"] else 0
    from rich.console import Console
    from rich.table import Table

    conf = f"{100 * result['confidence']:g}%"
    table = Table(
        title=(
            f"DP audit of {result['mechanism']} (noise x{result['noise_scale']:g}) at "
            f"epsilon={result['epsilon']:g}, delta={result['delta']:g}: whole runs of "
            f"{result['rounds']} release(s); claim: {result['claim']} "
            f"(run epsilon {result['epsilon_claimed']:.4f}, a guess right at most "
            f"{result['accuracy_claimed_max']:.4f})"
        )
    )
    for col in (
        "mode",
        "trials",
        "accuracy",
        f"accuracy lower ({conf})",
        "mu lower",
        "mu claimed",
        f"eps at delta lower ({conf})",
        "GDP estimate (not used)",
        "sees noise x",
        "flagged",
        "seconds",
    ):
        table.add_column(col, justify="right")
    for mode, res in result["modes"].items():
        table.add_row(
            mode,
            f"{res['trials']} ({res['clients']} x {res['canaries_per_client']})"
            if mode == "release"
            else str(res["trials"]),
            f"{res['accuracy']:.4f}",
            f"{res['accuracy_lower_bound']:.4f}",
            f"{res['mu_lower_bound']:.4f}",
            f"{result['mu_claimed']:.4f}",
            f"{res['epsilon_lower_bound']:.4f}",
            f"{res['gdp_estimate']['epsilon_lower_bound']:.4f}",
            f"{res['detectable_noise_scale']:.2f}",
            "yes" if res["violation"] else "no",
            f"{res['seconds']:.1f}",
        )
    Console(width=180).print(table)
    if result["violation"]:
        flagged = list(result["modes"].values())
        reasons = []
        if any(r["flagged_balanced"] for r in flagged):
            reasons.append(
                f"a guess of the canary is right with probability >= "
                f"{result['accuracy_lower_bound']:.4f} > {result['accuracy_claimed_max']:.4f} "
                f"claimed (no mu-GDP claim with mu < {result['mu_lower_bound']:.4f} holds, "
                f"i.e. epsilon {result['epsilon_gdp_refuted']:.4f} at delta)"
            )
        if any(r["flagged_tail"] for r in flagged):
            reasons.append(
                f"epsilon at delta >= {result['epsilon_lower_bound']:.4f} > "
                f"{result['epsilon_claimed']:.4f} claimed"
            )
        print(f"VIOLATION ({conf}, model-free): " + "; ".join(reasons))
    else:
        print(
            f"no violation ({conf}, model-free): accuracy lower bound "
            f"{result['accuracy_lower_bound']:.4f} <= {result['accuracy_claimed_max']:.4f} "
            f"claimed, epsilon at delta lower bound {result['epsilon_lower_bound']:.4f} <= "
            f"{result['epsilon_claimed']:.4f}; this audit sees a Gaussian mechanism adding "
            f"less than {result['detectable_noise_scale']:.2f} x the claimed noise"
        )
    return 1 if result["violation"] else 0


def add_attack_parsers(subparsers: Any) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """Register ``attack`` and ``audit`` on an argparse subparsers object."""
    attack: argparse.ArgumentParser = subparsers.add_parser(
        "attack", help="membership inference or feature-space hijacking on a finished run"
    )
    attack.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (with artifacts.pt)")
    attack.add_argument("--attack", choices=("mia", "fsh"), default="mia")
    attack.add_argument(
        "--round",
        type=int,
        default=None,
        help="release round to attack (1-based; default: the last)",
    )
    attack.add_argument("--client", default=None, help="attack one client (default: all)")
    attack.add_argument("--seed", type=int, default=0)
    attack.add_argument(
        "--max-per-class",
        type=int,
        default=800,
        help="MIA: members and non-members kept per class (default 800)",
    )
    attack.add_argument(
        "--steps",
        type=int,
        default=300,
        help="FSH: step cap of the optimisation (default 300; the paper 10000)",
    )
    attack.add_argument(
        "--patience", type=int, default=300, help="FSH: early-stopping patience (default 300)"
    )
    attack.add_argument(
        "--samples",
        type=int,
        default=2,
        help="FSH: reconstructions per target prototype (default 2)",
    )
    attack.add_argument(
        "--device",
        default=None,
        help="where the attack computes (auto, cpu, cuda, cuda:N; default: the run's "
        "run.device): FSH's optimisation, MIA's features",
    )
    attack.add_argument("--json", action="store_true", help="print the result as JSON")
    attack.set_defaults(func=_cmd_attack)

    audit: argparse.ArgumentParser = subparsers.add_parser(
        "audit",
        help="model-free test of a mechanism's claimed privacy over whole runs (exit 1 on a "
        "violation)",
    )
    audit.add_argument(
        "--mechanism",
        choices=private_mechanisms() + sum_mechanisms(),
        required=True,
        help="a per-client mechanism (its releases audited one by one) or ddg (the server's "
        "view: the decoded secure sum of --clients clients)",
    )
    audit.add_argument(
        "--clients",
        type=int,
        default=10,
        help="ddg: clients in each secure sum (default 10)",
    )
    audit.add_argument("--epsilon", type=float, required=True)
    audit.add_argument("--delta", type=float, default=1e-5)
    audit.add_argument(
        "--trials",
        type=int,
        default=AUDIT_TRIALS,
        help=f"trials: canaries, each in a whole run (default {AUDIT_TRIALS})",
    )
    audit.add_argument(
        "--release-trials",
        type=int,
        default=AUDIT_TRIALS,
        help=f"trials of the release mode under --mode both (default {AUDIT_TRIALS})",
    )
    audit.add_argument(
        "--mode",
        choices=AUDIT_MODES,
        default="release",
        help="release: the real releases (default); fast: simulated Gaussian noise of the "
        "stated std; both",
    )
    audit.add_argument(
        "--canaries",
        type=int,
        default=AUDIT_CANARIES,
        help=f"canaries per client, one per class (default {AUDIT_CANARIES})",
    )
    audit.add_argument(
        "--claim",
        choices=AUDIT_CLAIMS,
        default="profile",
        help="profile: the accountant's whole privacy profile of the run (default); point: "
        "the run's (epsilon, delta) alone",
    )
    audit.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="releases per trial: calibrate for T releases and audit all T (default 20)",
    )
    audit.add_argument(
        "--confidence",
        type=float,
        default=0.99,
        help="confidence level of the verdict and the bounds (default 0.99)",
    )
    audit.add_argument(
        "--noise-scale",
        type=float,
        default=1.0,
        help="audit a copy whose noise is scaled by F (F < 1 must be flagged: checks the auditor)",
    )
    audit.add_argument("--dim", type=int, default=32, help="feature dimension (default 32)")
    audit.add_argument(
        "--neighbouring",
        choices=("replace_one", "add_remove"),
        default="replace_one",
        help="the relation audited (add_remove: the canary present or a zero example)",
    )
    audit.add_argument(
        "--sample-rate",
        type=float,
        default=1.0,
        help="Poisson subsampling q of each release (add_remove, igpp; release mode)",
    )
    audit.add_argument("--seed", type=int, default=0)
    audit.add_argument("--json", action="store_true", help="print the result as JSON")
    audit.set_defaults(func=_cmd_audit)
    return attack, audit


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m protofl.attacks.cli``)."""
    parser = argparse.ArgumentParser(prog="protofl")
    sub = parser.add_subparsers(dest="command", required=True)
    add_attack_parsers(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"protofl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
