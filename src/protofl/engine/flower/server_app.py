"""The Flower ``ServerApp``: runs :class:`ProtoStrategy` and writes a protofl run folder.

The run folder is a protofl run folder like the simulator's (config.yaml, run-record.json,
run.log, metrics.jsonl, summary.json, artifacts.pt) and holds the server's checkpoint after
every round (``checkpoint-<round>.pt``: the strategy's state, see
:meth:`ProtoStrategy.state_dict`), from which :func:`run_flower_server` continues a stopped
run (``resume``).  Clients keep their own state on their nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from protofl.config import ExperimentConfig
from protofl.engine.flower.client_app import config_from_run_config
from protofl.engine.flower.plan import FederationPlan
from protofl.engine.flower.strategy import ProtoStrategy
from protofl.engine.simulation import RoundMetrics, summarise

log = logging.getLogger(__name__)

DEFAULT_ROUND_TIMEOUT = 600.0
DEFAULT_WAIT_TIMEOUT = 300.0


@dataclass
class ServerOutcome:
    """What one ServerApp run produced (filled in by the app, read by the caller)."""

    summary: dict[str, Any] = field(default_factory=dict)
    history: list[RoundMetrics] = field(default_factory=list)
    run_dir: Path | None = None
    strategy: ProtoStrategy | None = None


def format_partition_map(partition_map: Mapping[int, int]) -> str:
    """``{node id: partition}`` as the run config's ``partition-map`` ("ID:P,ID:P")."""
    return ",".join(f"{node}:{part}" for node, part in sorted(partition_map.items()))


def parse_partition_map(text: str) -> dict[int, int]:
    """The run config's ``partition-map`` ("ID:P,ID:P"; empty: none) as node id -> partition."""
    out: dict[int, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        node, sep, part = item.partition(":")
        try:
            if not sep:
                raise ValueError
            node_id, partition = int(node), int(part)
        except ValueError:
            raise ValueError(
                f"partition-map entry {item!r}: expected NODE_ID:PARTITION, e.g. '812:0,977:1'"
            ) from None
        if partition < 0:
            raise ValueError(f"partition-map entry {item!r}: a partition is >= 0")
        if node_id in out:
            raise ValueError(f"partition-map: node {node_id} is bound twice")
        if partition in out.values():
            raise ValueError(f"partition-map: partition {partition} is bound to two nodes")
        out[node_id] = partition
    return out


def build_summary(config: ExperimentConfig, strategy: ProtoStrategy) -> dict[str, Any]:
    """The run summary, in the in-process runner's layout (``summary.json``)."""
    from protofl.engine.runner import environment

    if not strategy.history:
        raise RuntimeError("no round completed")
    nodes = strategy.registered_nodes()
    summary = summarise(strategy.history)
    summary.update(
        {
            "name": config.name,
            "method": config.method.name,
            "dataset": config.data.name,
            "domains": sorted({n.domain_name for n in nodes}),
            "clients": [n.name for n in nodes],
            "num_train": {n.name: n.num_samples for n in nodes},
            "privacy": {
                **strategy.mechanism.describe(),
                **strategy.privacy_status(),
                "dcr": config.privacy.use_dcr,
                "guarantee": strategy.guarantee(),
            },
            "engine": "flower",
            "wire_fields": {k: sorted(v) for k, v in sorted(strategy.wire_seen.items())},
            "rejected_total": sum(len(h.rejected) for h in strategy.history),
            "rebinds": strategy.rebinds,
            "partition_map": {str(n): p for n, p in sorted(strategy.partition_map.items())},
            "weighting": strategy.weighting_summary(),
            "units": "accuracies are fractions in [0, 1]; tables show percentages",
            "environment": environment(),
        }
    )
    try:
        import flwr

        summary["environment"]["flwr"] = flwr.__version__
    except Exception:  # pragma: no cover
        pass
    return summary


def make_server_app(
    config: ExperimentConfig | None = None,
    *,
    out: str | Path | None = None,
    min_nodes: int | None = None,
    round_timeout: float | None = None,
    wait_timeout: float | None = None,
    outcome: ServerOutcome | None = None,
    on_round: Callable[[RoundMetrics], None] | None = None,
    diagnostics: bool = False,
    run_dir: Path | None = None,
    resume: bool = False,
    plan: FederationPlan | None = None,
) -> ServerApp:
    """A ServerApp running ``ProtoStrategy``.

    Values not given here come from the run config: ``protofl-config``/``protofl-set`` (the
    experiment), ``round-timeout``, ``wait-timeout``, ``min-nodes`` (0: as many as the run has
    clients), ``out-dir`` (a run folder is written there; empty: none) and ``partition-map``
    (node id -> partition from the registered SuperNode keys; empty: first claim wins).
    ``run_dir``/``resume``/``plan``: as :func:`run_flower_server`.  A run folder written by a
    deployment (``config`` None: the shipped components under ``flwr run``) records the engine
    ``flower-deployment``: protofl cannot restart a deployment's SuperNodes, so it does not
    resume it.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        cfg = config if config is not None else config_from_run_config(rc)
        timeout = round_timeout if round_timeout is not None else rc.get("round-timeout")
        wait = wait_timeout if wait_timeout is not None else rc.get("wait-timeout")
        nodes = min_nodes if min_nodes is not None else int(rc.get("min-nodes", 0)) or None  # type: ignore[call-overload]
        out_dir = out if out is not None else (str(rc.get("out-dir", "")) or None)
        run_flower_server(
            grid,
            cfg,
            out=out_dir,
            partition_map=parse_partition_map(str(rc.get("partition-map", ""))),
            min_nodes=nodes,
            round_timeout=float(timeout) if timeout is not None else DEFAULT_ROUND_TIMEOUT,  # type: ignore[arg-type]
            wait_timeout=float(wait) if wait is not None else DEFAULT_WAIT_TIMEOUT,  # type: ignore[arg-type]
            outcome=outcome,
            on_round=on_round,
            diagnostics=diagnostics,
            run_dir=run_dir,
            resume=resume,
            engine="flower" if config is not None else "flower-deployment",
            plan=plan,
        )

    return app


def run_flower_server(
    grid: Grid,
    config: ExperimentConfig,
    *,
    out: str | Path | None,
    min_nodes: int | None,
    round_timeout: float,
    wait_timeout: float,
    outcome: ServerOutcome | None = None,
    on_round: Callable[[RoundMetrics], None] | None = None,
    diagnostics: bool = False,
    partition_map: Mapping[int, int] | None = None,
    run_dir: Path | None = None,
    resume: bool = False,
    engine: str = "flower",
    plan: FederationPlan | None = None,
) -> ServerOutcome:
    """Run the strategy on ``grid`` and write a run folder: a new one under ``out`` (when
    given), or ``run_dir`` (already started, e.g. by :func:`start_run_dir`).  The server
    checkpoints after every round (unless ``federation.checkpoint`` is false), keeping the
    latest ``federation.keep_checkpoints`` (0: all); ``resume`` continues ``run_dir`` from its
    last checkpoint up to its rounds (configured plus extensions).  ``partition_map``: node
    id -> the one partition that node may claim (None or empty: first claim wins).  ``plan``:
    what the federation is
    (:func:`~protofl.engine.flower.plan.plan_from_data` where the caller built the
    federated data, so every partition's sample count is known; None: the configured data
    set's classes, domains and clients,
    :func:`~protofl.engine.flower.plan.plan_from_config`)."""
    from protofl.engine.checkpoint import load_latest_checkpoint, save_checkpoint
    from protofl.engine.extension import extended_privacy
    from protofl.engine.rundir import (
        FolderLock,
        append_round,
        read_extensions,
        rewrite_rounds,
        target_rounds,
        write_summary,
    )
    from protofl.engine.runner import attach_log, make_run_dir, start_run_dir

    outcome = outcome if outcome is not None else ServerOutcome()
    created = run_dir is None and out is not None  # removed again if no round completes
    if run_dir is None and out is not None:
        run_dir = make_run_dir(config, out)
        start_run_dir(config, run_dir, engine=engine)
    outcome.run_dir = run_dir
    lock = FolderLock(run_dir, "run") if run_dir is not None else None
    if lock is not None:
        lock.acquire()  # one process at a time in a run folder
    handler = attach_log(run_dir) if run_dir is not None else None
    try:
        target = target_rounds(run_dir, config) if run_dir is not None else None
        extensions = read_extensions(run_dir) if run_dir is not None else []

        def record(m: RoundMetrics) -> None:
            outcome.history.append(m)
            if run_dir is not None:  # local-only fields: client-local, or dropped (deployment)
                append_round(run_dir, m.to_json(), keep_local=diagnostics)
                if config.federation.checkpoint:  # every round: the clients move every round
                    # the latest federation.keep_checkpoints are kept (0: all), as the simulator
                    save_checkpoint(
                        run_dir,
                        m.round,
                        strategy.state_dict(),
                        keep=config.federation.keep_checkpoints,
                    )
            if on_round is not None:
                on_round(m)

        strategy = ProtoStrategy(
            config,
            min_nodes=min_nodes,
            round_timeout=round_timeout,
            wait_timeout=wait_timeout,
            on_round=record,
            diagnostics=diagnostics,
            plan=plan,
        )
        strategy.partition_map = dict(partition_map or {})
        outcome.strategy = strategy
        if run_dir is not None and resume:
            state = load_latest_checkpoint(run_dir)
            if state is not None:
                strategy.load_state_dict(state)
            elif not config.federation.checkpoint and any((run_dir / "nodes").glob("*/*.pt")):
                raise RuntimeError(
                    f"{run_dir}: the server kept no checkpoint (federation.checkpoint=false) "
                    "but its clients have released; restarting from round 1 would charge them "
                    "again: start a new run"
                )
            log.info("resuming %s after round %d", run_dir, len(strategy.history))
            outcome.history = list(strategy.history)
        if run_dir is not None:  # a round written after the last checkpoint is written again
            rewrite_rounds(run_dir, [m.to_json() for m in strategy.history], keep_local=diagnostics)
        todo = (target if target is not None else config.federation.rounds) - len(strategy.history)
        if todo > 0:
            try:
                strategy.start(grid=grid, num_rounds=todo)
            except TimeoutError as exc:
                if strategy.history or "registered within" not in str(exc):
                    raise
                raise TimeoutError(
                    f"{exc}: the federation did not start. Start one SuperNode per client "
                    f"({strategy.num_clients or 'see the config'}); in Flower's local "
                    "simulation: flwr run APP local --stream --federation-config "
                    f'"num-supernodes={strategy.num_clients or "N"}"'
                ) from exc
        outcome.summary = build_summary(config, strategy)
        outcome.summary["privacy"] = extended_privacy(outcome.summary["privacy"], extensions)
        if run_dir is not None:
            outcome.summary["run_dir"] = str(run_dir)
            write_summary(run_dir, outcome.summary, keep_local=diagnostics)
            if config.run.save_releases:
                save_received(strategy, run_dir)
        log.info("flower run finished: avg %.4f", outcome.summary["avg_acc"])
    except BaseException:
        failed = True
        raise
    else:
        failed = False
    finally:
        if handler is not None:
            logging.getLogger("protofl").removeHandler(handler)
            handler.close()
        if lock is not None:
            lock.release()
        if created and failed and run_dir is not None and not outcome.history:
            _remove_empty_run(run_dir)
            outcome.run_dir = None
    return outcome


def _remove_empty_run(run_dir: Path) -> None:
    """Remove a run folder this server started but that holds no round (the federation did not
    start): it would only look like a run.  Its ``run.log`` goes to the log first."""
    import shutil

    from protofl.engine.rundir import CLIENT_LOCAL_SUFFIX

    try:
        text = (run_dir / "run.log").read_text(errors="replace").strip()
    except OSError:
        text = ""
    if text:
        log.error("run.log of the removed run folder %s:\n%s", run_dir, text[-4000:])
    log.error("no round completed: removed the run folder %s", run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(run_dir.with_name(run_dir.name + CLIENT_LOCAL_SUFFIX), ignore_errors=True)


def save_received(strategy: ProtoStrategy, run_dir: Path) -> None:
    """``artifacts.pt`` of a Flower run: every round's releases as the server received and
    accepted them (client models never reach the server, so the attacks cannot run on it)."""
    import torch

    from protofl.privacy.base import release_to_dict

    nodes = strategy.registered_nodes()
    parts = [n.partition for n in nodes]
    torch.save(
        {
            "engine": "flower",
            "releases": [[release_to_dict(rnd.get(p)) for p in parts] for rnd in strategy.received],
            "clients": [n.name for n in nodes],
            "domains": [n.domain_name for n in nodes],
        },
        run_dir / "artifacts.pt",
    )
