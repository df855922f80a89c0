"""Sub-commands ``sweep``, ``table``, ``report`` and ``plot`` (wired into ``protofl.cli``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from protofl.report.tables import HEADLINE, METRIC_CHOICES

PLOT_KINDS = (
    "accuracy",
    "avg",
    "privacy-utility",
    "feature-norms",
    "tsne",
    "attacks",
    "epsilon",
)


def _split_by(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [k.strip() for k in text.split(",") if k.strip()]


def _print_skipped(skipped: list[tuple[Path, str]]) -> None:
    for path, why in skipped:
        print(f"protofl: skipped {path}: {why}", file=sys.stderr)


def _finished_runs(args: argparse.Namespace) -> list[Any]:
    """The finished runs among ``args.runs`` that match ``--where``; skipped folders are listed
    on stderr; no run left is an error naming why."""
    from protofl.report.tables import collect_runs, filter_runs

    runs, skipped = collect_runs(args.runs, metric=args.metric)
    _print_skipped(skipped)
    if runs and args.where:
        runs = filter_runs(runs, args.where)
        if not runs:
            raise ValueError(f"no finished run matches --where {' '.join(args.where)}")
    if not runs:
        raise ValueError(
            f"no finished runs among {', '.join(args.runs)}"
            + (f" ({len(skipped)} folders skipped, listed above)" if skipped else "")
        )
    return runs


# --------------------------------------------------------------------------------------------
# sweep
# --------------------------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    """Validate the grid, run what is not complete, print the summary (exit 1 if runs failed)."""
    from protofl.sweeps import (
        SELECT_DIR,
        format_selection,
        format_sweep_result,
        load_sweep,
        run_selection,
        run_sweep,
    )

    plan = load_sweep(args.sweep_file, args.set or (), select=args.select)
    if args.no_fuse:
        plan.fuse = False
    sweep_dir = Path(args.out) if args.out else plan.default_dir()
    if args.dry_run:
        from protofl.sweeps import run_is_done

        if plan.select is not None:
            sel = plan.select
            print(
                f"sweep {plan.name}: {len(plan.validation)} validation runs in "
                f"{sweep_dir / SELECT_DIR} choosing {sel.key} among "
                f"{', '.join(str(v) for v in sel.values)}, then {len(plan.points)} test runs "
                f"in {sweep_dir} (all configs valid)"
            )
            for v in plan.validation:
                done = run_is_done(v.point.run_dir(sweep_dir / SELECT_DIR))
                print(f"  {v.point.dirname}  {'done' if done else 'to run'}  {v.point.label()}")
            return 0
        print(f"sweep {plan.name}: {len(plan.points)} runs in {sweep_dir} (all configs valid)")
        for p in plan.points:
            done = run_is_done(p.run_dir(sweep_dir))
            print(f"  {p.dirname}  {'done' if done else 'to run'}  {p.label()}")
        return 0
    try:
        if plan.select is not None:
            selection = run_selection(
                plan,
                sweep_dir=sweep_dir,
                jobs=args.jobs,
                progress=not args.quiet,
                warm_cache=not args.no_warm_cache,
            )
            print(format_sweep_result(selection.validation))
            print(format_sweep_result(selection.test))
            print(format_selection(selection.record))
            result = selection.test
            failed = bool(selection.failed)
        else:
            result = run_sweep(
                plan,
                sweep_dir=sweep_dir,
                jobs=args.jobs,
                progress=not args.quiet,
                warm_cache=not args.no_warm_cache,
            )
            print(format_sweep_result(result))
            failed = bool(result.failed)
    except KeyboardInterrupt as exc:
        from protofl.sweeps import resume_command

        by = f" by {exc}" if str(exc) else ""
        again = resume_command(
            args.sweep_file, sweep_dir, args.set or (), select=args.select, no_fuse=args.no_fuse
        )
        print(f"protofl: sweep stopped{by}; `{again}` continues it", file=sys.stderr)
        return 130
    if not args.no_table and any(r.status == "done" for r in result.runs):
        from protofl.report.tables import aggregate, collect_runs, format_table

        runs, _ = collect_runs([result.sweep_dir])
        if runs:
            print()
            print(format_table(aggregate(runs, metric=HEADLINE), "md"), end="")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------
def cmd_table(args: argparse.Namespace) -> int:
    """Aggregate finished runs into a Markdown, CSV or LaTeX table."""
    from protofl.report.tables import aggregate, describe_metric, format_table

    runs = _finished_runs(args)
    text = format_table(aggregate(runs, _split_by(args.by), args.metric), args.format, args.digits)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    if args.caption:
        print(describe_metric(args.metric), file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html and report.md into a run or sweep folder."""
    from protofl.progress import progress_notes
    from protofl.report.html import write_report

    with progress_notes(True):  # the t-SNE alone takes tens of seconds
        html_path, md_path = write_report(
            args.folder,
            by=_split_by(args.by),
            metric=args.metric,
            tsne=not args.no_tsne,
            tsne_points=args.tsne_points,
        )
    print(f"wrote {html_path}")
    print(f"wrote {md_path}")
    return 0


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> int:
    """Draw one figure (PNG and SVG) from run or sweep folders."""
    from protofl.report import plots
    from protofl.report.tables import aggregate, display_key, format_value

    runs = _finished_runs(args)
    kind = args.kind
    if args.out:
        stem = Path(args.out)
        if stem.suffix in (".png", ".svg"):
            stem = stem.with_suffix("")
    else:
        first = Path(args.runs[0])
        stem = (first / "figures" if len(args.runs) == 1 else Path(".")) / kind.replace("-", "_")
    single = kind in ("accuracy", "tsne", "epsilon")
    if single and len(runs) > 1:
        raise ValueError(f"plot {kind} draws one run; {len(runs)} runs were given")
    paths: list[Path]
    if kind == "accuracy":
        paths = plots.plot_accuracy(runs[0], stem)
    elif kind == "epsilon":
        paths = plots.plot_epsilon(runs[0], stem)
    elif kind == "tsne":
        paths = plots.plot_tsne(runs[0], stem, max_points=args.max_points, split=args.split)
    elif kind == "privacy-utility":
        paths = plots.plot_privacy_utility(runs, stem, args.metric)
    elif kind == "feature-norms":
        paths = plots.plot_feature_norms(runs, stem)
    elif kind == "attacks":
        metrics = _split_by(args.attack_metrics)
        paths = plots.plot_attacks(runs, stem, metrics)
    else:  # avg
        table = aggregate(runs, _split_by(args.by), args.metric)
        groups: dict[str, Any] = {}
        for g in table.groups:
            label = ", ".join(
                [f"{display_key(k)}={format_value(k, v)}" for k, v in zip(table.by, g.key)]
                + [f"{h}={v}" for h, v in zip(table.extra_heads(), table.extra_values(g))]
            )
            groups[label or "all runs"] = g.runs
        paths = plots.plot_avg_per_round(groups, stem)
    for p in paths:
        print(f"wrote {p}")
    return 0


# --------------------------------------------------------------------------------------------
# parsers
# --------------------------------------------------------------------------------------------
def add_report_parsers(subparsers: Any) -> None:
    """Register ``sweep``, ``table``, ``report`` and ``plot`` on an argparse sub-parser set."""
    sw = subparsers.add_parser(
        "sweep",
        help="run a grid of experiments in parallel (skips finished runs, resumes stopped ones)",
        description="Run every point of a sweep file's grid; see docs/reporting.md.",
    )
    sw.add_argument("sweep_file", help="YAML with base: (config or path), grid: and name:")
    sw.add_argument(
        "-j", "--jobs", type=int, help="worker processes (default: the number of cores)"
    )
    sw.add_argument("--out", help="sweep folder (default: <base run.out_dir>/<sweep name>)")
    sw.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="replace a grid axis (seed=[1,2]) or set a base config key "
        "(federation.checkpoint=false); repeatable",
    )
    sw.add_argument(
        "--select",
        metavar="KEY[=VALUES]",
        help="choose KEY on validation splits of the clients' training data, never the test "
        "set, per grid group, then run the choice on test (privacy.clip: 5, 10, 15, 20 by "
        "default; privacy.clip=[5,10] for others); sets the sweep file's select.key",
    )
    sw.add_argument("--quiet", action="store_true", help="no progress display")
    sw.add_argument(
        "--dry-run", action="store_true", help="validate every point and list them; run nothing"
    )
    sw.add_argument(
        "--no-warm-cache",
        action="store_true",
        help="do not precompute frozen features in the main process",
    )
    sw.add_argument("--no-table", action="store_true", help="do not print the result table")
    sw.add_argument(
        "--no-fuse",
        action="store_true",
        help="run every point on its own (default: batched points that differ only in seed "
        "and privacy settings run fused, as one program; sweep file key fuse:)",
    )
    sw.set_defaults(func=cmd_sweep)

    tb = subparsers.add_parser(
        "table",
        help="paper-style table (per-domain accuracy, AVG, STD) from finished runs",
        description="Aggregate run folders, sweep folders and folders of them (searched below, "
        "sweep sub-folders included) into one table, grouped by what ran.",
    )
    tb.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run, sweep or runs folders")
    tb.add_argument(
        "--by",
        help="comma-separated keys to group by (method, mechanism, epsilon, rounds, engine, "
        "dataset, dcr, seed, ... or dotted config keys); epsilon is the epsilon spent and rounds "
        "the rounds run, configured_epsilon and configured_rounds what the config asked for; "
        "default: the keys that differ among the runs (engines and extended runs always get "
        "rows of their own)",
    )
    tb.add_argument("--format", choices=("md", "csv", "latex", "html"), default="md")
    tb.add_argument(
        "--metric",
        choices=METRIC_CHOICES,
        default=HEADLINE,
        help="headline (default): each run's run.headline, named in a metric column; final: "
        "the final round for every run (VPDR); last5: the mean of the last 5 rounds (FedDAP)",
    )
    tb.add_argument("--digits", type=int, default=2, help="decimals shown (default 2)")
    tb.add_argument(
        "--where",
        action="append",
        metavar="KEY=VALUE",
        help="keep only runs with this value (method=fedproto, epsilon=1: the epsilon spent; "
        "configured_epsilon=1: the config's); repeatable",
    )

    tb.add_argument("--output", "-o", help="write the table to this file")
    tb.add_argument(
        "--caption", action="store_true", help="print what the numbers mean (to stderr)"
    )
    tb.set_defaults(func=cmd_table)

    rp = subparsers.add_parser(
        "report",
        help="write report.html (self-contained) and report.md into a run or sweep folder",
    )
    rp.add_argument("folder", metavar="RUN_OR_SWEEP_DIR")
    rp.add_argument("--by", help="group keys for the sweep tables (default: varying keys)")
    rp.add_argument("--metric", choices=METRIC_CHOICES, default="final")
    rp.add_argument("--no-tsne", action="store_true", help="skip the t-SNE figure of a run")
    rp.add_argument("--tsne-points", type=int, default=1000)
    rp.set_defaults(func=cmd_report)

    pl = subparsers.add_parser("plot", help="draw one figure (PNG and SVG)")
    pl.add_argument("kind", choices=PLOT_KINDS)
    pl.add_argument("runs", nargs="+", metavar="RUN_DIR")
    pl.add_argument(
        "--out", help="output stem (default: RUN_DIR/figures/KIND, or ./KIND for several)"
    )
    pl.add_argument("--metric", choices=METRIC_CHOICES, default="final")
    pl.add_argument("--by", help="group keys for kind avg")
    pl.add_argument(
        "--where",
        action="append",
        metavar="KEY=VALUE",
        help="keep only runs whose config has this value (method=fedproto, epsilon=1); repeatable",
    )

    pl.add_argument("--max-points", type=int, default=1500, help="t-SNE subsample")
    pl.add_argument("--split", choices=("test", "train"), default="test", help="t-SNE data")
    pl.add_argument("--attack-metrics", help="comma-separated, e.g. mia_auc,mia_advantage")
    pl.set_defaults(func=cmd_plot)
