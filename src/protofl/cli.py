"""The ``protofl`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from protofl._version import __version__
from protofl.config import ConfigError, ExperimentConfig


def _flower_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "backend": args.flower_backend,
        "num_cpus": args.flower_num_cpus,
        "round_timeout": args.round_timeout,
        "ray_address": args.ray_address,
    }


def _print_result(args: argparse.Namespace, result: Any) -> None:
    from protofl.report.console import print_summary

    if args.json:
        print(json.dumps({"run_dir": str(result.run_dir), **result.summary}, indent=2))
    else:
        print_summary(result.summary, str(result.run_dir))


def _cmd_extend(args: argparse.Namespace) -> int:
    from protofl.engine.engines import EngineOptions, resume_run
    from protofl.engine.extension import check_extend_rounds

    check_extend_rounds(args.rounds)
    options = EngineOptions(progress=not args.quiet, flower=_flower_options(args))
    _print_result(args, resume_run(args.run_dir, options, extend=args.rounds))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from protofl.engine.engines import ENGINE_REGISTRY, EngineOptions, run_engine

    if args.resume:
        from protofl.engine.engines import resume_run

        if args.config or args.set:
            raise ValueError(
                "--resume continues a run with its saved config on its engine; drop CONFIG/--set"
            )
        options = EngineOptions(progress=not args.quiet, flower=_flower_options(args))
        result: Any = resume_run(args.resume, options, engine=args.engine)
    else:
        config = ExperimentConfig.from_yaml(args.config) if args.config else ExperimentConfig()
        overrides = list(args.set or [])
        if args.engine:  # shorthand for --set run.engine=NAME
            overrides.append(f"run.engine={args.engine}")
        config = config.with_overrides(overrides)
        ENGINE_REGISTRY.get(config.run.engine)  # an unknown engine fails before anything
        flower = _flower_options(args)
        if config.run.engine == "flower-loopback":
            flower = {"round_timeout": args.round_timeout}
        options = EngineOptions(out=args.out, progress=not args.quiet, flower=flower)
        result = run_engine(config, options)
    _print_result(args, result)
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from protofl.data import DATASET_REGISTRY
    from protofl.data.cache import protofl_home

    home = protofl_home()
    table = Table(title=f"data sets (cache: {home})")
    for col in ("name", "available locally", "description", "how to get it"):
        table.add_column(col)
    for name in DATASET_REGISTRY:
        info = DATASET_REGISTRY.get(name)
        table.add_row(
            name, "yes" if info.is_available(home) else "no", info.description, info.how_to_get
        )
    Console(width=160).print(table)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    config = ExperimentConfig.from_yaml(args.config) if args.config else ExperimentConfig()
    print(config.with_overrides(args.set or []).to_yaml(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per task)."""
    parser = argparse.ArgumentParser(
        prog="protofl",
        description="Privacy-preserving prototype-based personalized federated learning.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log to the console too")
    parser.add_argument("--version", action="version", version=f"protofl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment (default: fedproto on digits4)")
    run.add_argument("config", nargs="?", help="experiment YAML (default: the embedded default)")
    run.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key, e.g. federation.rounds=2 (repeatable)",
    )
    run.add_argument("--out", help="folder that receives the run folder (default: run.out_dir)")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run from its last complete round, on the engine that made it "
        "(sim or flower; --engine, if given, must name that engine)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    from protofl.engine.engines import ENGINE_REGISTRY
    from protofl.engine.flower.run import add_flower_app_parser, add_flower_arguments

    run.add_argument(
        "--engine",
        choices=ENGINE_REGISTRY.names(),
        default=None,
        help="where the rounds run (shorthand for --set run.engine=NAME; default: run.engine, "
        "sim): "
        + "; ".join(f"{n}: {ENGINE_REGISTRY.get(n).summary}" for n in ENGINE_REGISTRY.names()),
    )
    add_flower_arguments(run)
    run.set_defaults(func=_cmd_run)

    ext = sub.add_parser(
        "extend",
        help="continue a finished run for more rounds (the epsilon spent grows; recorded)",
        description="Continue a finished run for N more rounds on its engine, at the noise it "
        "was calibrated with. The mechanism was calibrated for the configured rounds at "
        "(epsilon, delta); every further release costs privacy, so the run's guarantee becomes "
        "the accountant's epsilon for all releases made. extensions.json, summary.json and "
        "run.log state the original budget, the extension and the new total epsilon.",
    )
    ext.add_argument("run_dir", metavar="RUN_DIR", help="a finished run folder")
    ext.add_argument("--rounds", type=int, required=True, metavar="N", help="rounds to add (>= 1)")
    ext.add_argument("--quiet", action="store_true", help="no progress bar")
    ext.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_flower_arguments(ext)
    ext.set_defaults(func=_cmd_extend)

    ds = sub.add_parser("datasets", help="list data sets and whether each is available")
    ds.set_defaults(func=_cmd_datasets)

    cfg = sub.add_parser("config", help="print the fully resolved config")
    cfg.add_argument("config", nargs="?")
    cfg.add_argument("--set", action="append", metavar="KEY=VALUE")
    cfg.set_defaults(func=_cmd_config)

    from protofl.report.cli import add_report_parsers

    add_report_parsers(sub)
    add_flower_app_parser(sub)
    import protofl.attacks  # noqa: F401  (registers the engine's diagnostic hooks: run.mia_every)
    from protofl.attacks.cli import add_attack_parsers

    add_attack_parsers(sub)
    try:
        from protofl.privacy.cli import add_privacy_parser, run_privacy
    except ImportError:  # pragma: no cover
        pass
    else:
        priv = add_privacy_parser(sub)
        priv.set_defaults(func=run_privacy)
    return parser


def _continue_hint(args: argparse.Namespace, exc: BaseException) -> str:
    """How to continue an interrupted run: the exact command, with its folder."""
    from protofl.engine.rundir import resume_command

    run_dir = getattr(exc, "run_dir", None) or getattr(args, "resume", None)
    if run_dir is None and getattr(args, "command", None) == "extend":
        run_dir = args.run_dir
    if run_dir is None:  # an engine that did not say where it ran
        out = getattr(args, "out", None) or "runs"
        return f"`protofl run --resume RUN_DIR` continues it (RUN_DIR: its folder in {out}/)"
    return f"its finished rounds are kept: `{resume_command(run_dir)}` continues it"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; errors in input become one clear line and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"protofl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C: one line, not a traceback; the finished rounds and checkpoints are kept
        why = str(exc) or "interrupted"
        print(f"protofl: stopped ({why}); {_continue_hint(args, exc)}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`protofl sweep --dry-run | head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
