"""Grids of experiments: validate every point first, run them in parallel worker processes,
skip finished runs, resume stopped ones, and record the status of each in ``sweep.json``.

A sweep file::

    name: vpdr-vs-igpp            # optional (default: the file's stem)
    base: configs/digits4.yaml    # a config mapping, or a path (relative to the sweep file)
    grid:                         # dotted config key -> list of values (cartesian product)
      method.name: [fedproto, fpl]
      privacy.mechanism: [igpp, vpdr]
      privacy.epsilon: [0.5, 1.0]
      seed: [0, 1, 2]

Every grid point gets a deterministic folder ``<sweep_dir>/<index>-<slug>`` (a normal run folder).
A point whose folder holds ``summary.json`` is done and is skipped; one with checkpoints is
resumed from its last complete round; anything else starts afresh.  Each point runs on the
engine its ``run.engine`` names (:func:`protofl.engine.engines.run_engine_in_dir`: ``sim``, or
``flower`` with the sweep's ``flower`` options); an engine that cannot run in a given folder
(``flower-loopback``) is refused, naming ``run.engine``, before anything is created.

Fused runs (``fuse:``, default ``true``; ``protofl sweep --no-fuse`` turns it off)::

    fuse: true                    # run compatible points as one batched program

Points with ``federation.execution: batched`` that differ only in ``seed`` and ``privacy.*``
settings (mechanism, epsilon, noise seed, clip radius, ...; with DCR on, the DCR settings
must agree, since DCR trains with them; its soft clip takes each run's clip radius) form a
fused group: their clients train, evaluate and upload in one batched program
(:mod:`protofl.engine.fused`), each run keeping its own server step, ledger, noise streams and
run folder; results equal the separate runs to float rounding.  A group whose runs turn out
not to fit together (model shapes, a method that cannot batch, ...) runs its points one by one;
``sweep.log`` and each run's ``note`` in ``sweep.json`` say why.  Sequential points (the
default execution) never fuse, nor do points of another engine than ``sim`` (a fused group is
the in-process simulator's program): a ``run.engine: flower`` point always runs on its own.

Selecting a setting without looking at the test set (``select:``)::

    select:
      key: privacy.clip            # the setting to choose (not a grid axis)
      values: [5, 10, 15, 20]      # the candidates (default for privacy.clip: VPDR's grid)
      validation_fraction: 0.2     # share of every client's training data held out (default)
      metric: headline             # headline (each run's run.headline) | final | last5
      per: [method.name, privacy.mechanism]   # default: every grid axis but the seed

For every group of grid points that agree on ``per`` and every candidate value, one validation
run per grid point (seed) trains with ``data.validation_fraction`` set, so it evaluates on the
held-out part of the clients' training data and never reads the test set
(``<sweep_dir>/select/``). The value with the best mean validation accuracy over the group's
runs is chosen (a tie goes to the value listed first), then every grid point of the group runs
once more on its full training data with that value and reports test accuracy
(``<sweep_dir>/<index>-<slug>``). ``selection.json`` records the candidates, every validation
accuracy, the choice and the test accuracy at the choice, and what the selection costs in
privacy (``privacy``, per group and for the whole selection): every run releases the same
clients' training data, so the DP events of all validation and test runs are composed per client
(:func:`selection_privacy`), and the choice itself (argmax over validation accuracy computed on
private training data) is stated as not covered (``complete: false``).  Every validation and
test run's ``summary.json`` gets the same statement as ``privacy.selection``.
"""

from __future__ import annotations

from protofl.sweeps.plan import (
    LOG_FILE,
    SELECT_DIR,
    SELECTION_FILE,
    STATUS_FILE,
    SweepPlan,
    SweepPoint,
    apply_sweep_overrides,
    load_sweep,
    make_points,
    plan_sweep,
    point_slug,
)
from protofl.sweeps.privacy import TUNING_GAP, VALIDATION_GAP, selection_privacy
from protofl.sweeps.schedule import (
    format_selection,
    format_sweep_result,
    fusion_groups,
    resume_command,
    run_selection,
    run_sweep,
)
from protofl.sweeps.status import RunStatus, SweepResult, read_status, run_is_done
from protofl.sweeps.worker import execute_point

__all__ = [
    "LOG_FILE",
    "SELECTION_FILE",
    "SELECT_DIR",
    "STATUS_FILE",
    "TUNING_GAP",
    "VALIDATION_GAP",
    "RunStatus",
    "SweepPlan",
    "SweepPoint",
    "SweepResult",
    "apply_sweep_overrides",
    "execute_point",
    "format_selection",
    "format_sweep_result",
    "fusion_groups",
    "load_sweep",
    "make_points",
    "plan_sweep",
    "point_slug",
    "read_status",
    "resume_command",
    "run_is_done",
    "run_selection",
    "run_sweep",
    "selection_privacy",
]
