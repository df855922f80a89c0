"""Tables from hand-made run folders: known numbers in, known table out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from protofl.report.cli import add_report_parsers
from protofl.report.tables import aggregate, collect_runs, format_table, load_run


def make_run(
    root: Path,
    name: str,
    *,
    method: str,
    mechanism: str,
    seed: int,
    acc: dict[str, float],
    epsilon: float = 1.0,
    rows: list[dict[str, float]] | None = None,
    headline: str | None = None,
    record_headline: bool = True,
) -> Path:
    """A finished run folder with exactly these numbers (fractions); ``headline`` sets
    ``run.headline`` in the config and (with ``record_headline``) in summary.json."""
    d = root / name
    d.mkdir(parents=True)
    config: dict[str, Any] = {
        "name": name,
        "seed": seed,
        "method": {"name": method},
        "privacy": {"mechanism": mechanism, "epsilon": epsilon},
    }
    if headline is not None:
        config["run"] = {"headline": headline}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    vals = list(acc.values())
    rows = rows or [acc]
    metrics = []
    for i, r in enumerate(rows):
        v = list(r.values())
        metrics.append(
            {
                "round": i + 1,
                "acc": r,
                "avg_acc": float(np.mean(v)),
                "std_acc": float(np.std(v)),
                "train_loss": 1.0 / (i + 1),
                "wall_s": 0.5,
                "privacy": {},
                "holdout_acc": None,
            }
        )
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    summary: dict[str, Any] = {
        "acc": acc,
        "avg_acc": float(np.mean(vals)),
        "std_acc": float(np.std(vals)),
        "avg_acc_last5": float(np.mean([m["avg_acc"] for m in metrics[-5:]])),
        "rounds": len(rows),
        "wall_s": 1.0,
        "method": method,
        "dataset": "hand",
        "domains": list(acc),
        "privacy": {"mechanism": mechanism, "epsilon_spent": {"A": None, "B": None}},
    }
    if headline is not None and record_headline:
        key = "avg_acc_last5" if headline == "last5" else "avg_acc"
        summary["headline"] = {"metric": headline, "avg_acc": summary[key]}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    make_run(root, "r1", method="fedproto", mechanism="none", seed=0, acc={"A": 0.80, "B": 0.60})
    make_run(root, "r2", method="fedproto", mechanism="none", seed=1, acc={"A": 0.90, "B": 0.70})
    make_run(root, "r3", method="fedproto", mechanism="vpdr", seed=0, acc={"A": 0.70, "B": 0.66})
    make_run(root, "r4", method="fedproto", mechanism="vpdr", seed=1, acc={"A": 0.74, "B": 0.70})
    make_run(root, "r5", method="fpl", mechanism="vpdr", seed=0, acc={"A": 0.75, "B": 0.55})
    (root / "empty").mkdir()  # not a run: ignored when expanding the folder of runs
    stopped = root / "stopped"
    stopped.mkdir()
    (stopped / "config.yaml").write_text("seed: 0\n")  # a run that never finished
    return root


EXPECTED_MD = """\
| method | mechanism | n | A | B | AVG | STD |
|:--|:--|--:|--:|--:|--:|--:|
| fedproto | none | 2 | **85.00 ± 7.07** | 65.00 ± 7.07 | **75.00 ± 7.07** | 10.00 ± 0.00 |
| fedproto | vpdr | 2 | 72.00 ± 2.83 | **68.00 ± 2.83** | 70.00 ± 2.83 | **2.00 ± 0.00** |
| fpl | vpdr | 1 | 75.00 | 55.00 | 65.00 | 10.00 |
"""

# the same runs under the default --metric headline: none of them names a headline, so final
EXPECTED_MD_HEADLINE = """\
| method | mechanism | metric | n | A | B | AVG | STD |
|:--|:--|:--|--:|--:|--:|--:|--:|
| fedproto | none | final | 2 | **85.00 ± 7.07** | 65.00 ± 7.07 | **75.00 ± 7.07** | 10.00 ± 0.00 |
| fedproto | vpdr | final | 2 | 72.00 ± 2.83 | **68.00 ± 2.83** | 70.00 ± 2.83 | **2.00 ± 0.00** |
| fpl | vpdr | final | 1 | 75.00 | 55.00 | 65.00 | 10.00 |
"""


def test_markdown_table_mean_std_and_best(runs: Path) -> None:
    found, skipped = collect_runs([runs])
    assert [r.name for r in found] == ["r1", "r2", "r3", "r4", "r5"]
    assert [(p.name, why.split(":")[0]) for p, why in skipped] == [("stopped", "not finished")]
    table = aggregate(found, by=["method", "mechanism"])
    assert format_table(table, "md") == EXPECTED_MD


def test_latex_and_csv(runs: Path) -> None:
    found, _ = collect_runs([runs])
    table = aggregate(found, by=["method", "mechanism"])
    latex = format_table(table, "latex").splitlines()
    assert latex[0] == r"\begin{tabular}{llrrrrr}"
    assert latex[2] == r"method & mechanism & $n$ & A & B & AVG & STD \\"
    assert latex[4] == (
        r"fedproto & none & 2 & \textbf{85.00 $\pm$ 7.07} & 65.00 $\pm$ 7.07 & "
        r"\textbf{75.00 $\pm$ 7.07} & 10.00 $\pm$ 0.00 \\"
    )
    assert latex[-1] == r"\end{tabular}"
    csv_lines = format_table(table, "csv").splitlines()
    assert csv_lines[0] == (
        "method,mechanism,n,A_mean,A_std,B_mean,B_std,AVG_mean,AVG_std,STD_mean,STD_std,best"
    )
    assert csv_lines[1] == (
        "fedproto,none,2,85.0000,7.0711,65.0000,7.0711,75.0000,7.0711,10.0000,0.0000,A;AVG"
    )
    assert csv_lines[3] == "fpl,vpdr,1,75.0000,,55.0000,,65.0000,,10.0000,,"


def test_default_grouping_uses_keys_that_differ(runs: Path) -> None:
    found, _ = collect_runs([runs])
    table = aggregate(found)  # method, mechanism and epsilon differ (epsilon: none = infinity)
    assert table.by == ["method.name", "privacy.mechanism", "privacy.epsilon"]
    md = format_table(table, "md").splitlines()
    assert md[0] == "| method | mechanism | epsilon | n | A | B | AVG | STD |"
    assert md[2].startswith("| fedproto | none | ∞ | 2 |")


def test_last5_averages_the_last_five_rounds(tmp_path: Path) -> None:
    rows = [{"A": 0.1 * i, "B": 0.05 * i} for i in range(1, 8)]  # 7 rounds
    d = make_run(
        tmp_path, "long", method="fedproto", mechanism="none", seed=0, acc=rows[-1], rows=rows
    )
    rec = load_run(d)
    sc = rec.scores("last5")
    assert sc["A"] == pytest.approx(np.mean([0.3, 0.4, 0.5, 0.6, 0.7]))
    assert sc["B"] == pytest.approx(np.mean([0.15, 0.2, 0.25, 0.3, 0.35]))
    assert sc["AVG"] == pytest.approx(np.mean([(r["A"] + r["B"]) / 2 for r in rows[2:]]))
    assert sc["STD"] == pytest.approx(np.mean([abs(r["A"] - r["B"]) / 2 for r in rows[2:]]))
    final = rec.scores("final")
    assert final["A"] == pytest.approx(0.7)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="protofl")
    add_report_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_table_lists_and_skips_non_runs(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "not-a-run").mkdir()
    args = _parse(
        ["table", str(runs), str(tmp_path / "not-a-run"), str(tmp_path / "missing"),
         "--by", "method,mechanism"]
    )  # fmt: skip
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert out == EXPECTED_MD_HEADLINE  # by default each row says its runs' headline metric
    assert "stopped: not finished" in err
    assert "not-a-run: not a run folder" in err
    assert "missing: does not exist" in err
    args = _parse(["table", str(tmp_path / "not-a-run")])
    with pytest.raises(ValueError, match="no finished runs"):
        args.func(args)


def test_sweep_folder_expands_to_its_runs(runs: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for name in ("r1", "r3"):
        (runs / name).rename(sweep / name)
    (sweep / "sweep.json").write_text(
        json.dumps({"runs": [{"dir": "r3"}, {"dir": "r1"}, {"dir": "r9"}]})
    )
    found, skipped = collect_runs([sweep])
    assert [r.name for r in found] == ["r3", "r1"]  # grid order from sweep.json
    assert [p.name for p, _ in skipped] == ["r9"]


def test_where_keeps_only_matching_runs(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from protofl.report.tables import filter_runs

    found, _ = collect_runs([runs])
    assert [r.name for r in filter_runs(found, ["method=fedproto", "mechanism=vpdr"])] == [
        "r3",
        "r4",
    ]
    assert [r.name for r in filter_runs(found, ["epsilon=1"])] == ["r3", "r4", "r5"]  # 1 == 1.0
    assert [r.name for r in filter_runs(found, ["epsilon=null"])] == ["r1", "r2"]  # no privacy
    assert filter_runs(found, ["seed=7"]) == []
    with pytest.raises(ValueError, match="must look like key=value"):
        filter_runs(found, ["method"])
    args = _parse(["table", str(runs), "--by", "method,mechanism", "--where", "method=fpl"])
    assert args.func(args) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[2] == "| fpl | vpdr | final | 1 | 75.00 | 55.00 | 65.00 | 10.00 |"
    args = _parse(["table", str(runs), "--where", "method=fedpcl"])
    with pytest.raises(ValueError, match="no finished run matches --where method=fedpcl"):
        args.func(args)


# ----- --metric headline (default): each run's run.headline --------------------------------------
def _headline_runs(root: Path) -> Path:
    """Two final-headline FedProto seeds and two last5-headline FedDAP seeds, 6 rounds each
    (round i: A = 0.1 * i + offset, B = 0.05 * i + offset)."""
    for method, headline, offsets in (
        ("fedproto", "final", (0.0, 0.02)),
        ("feddap", "last5", (0.1, 0.12)),
    ):
        for seed, off in enumerate(offsets):
            rows = [{"A": 0.1 * i + off, "B": 0.05 * i + off} for i in range(1, 7)]
            make_run(
                root, f"{method}-{seed}", method=method, mechanism="none", seed=seed,
                acc=rows[-1], rows=rows, headline=headline,
            )  # fmt: skip
    return root


def test_default_metric_follows_each_runs_headline(tmp_path: Path) -> None:
    root = _headline_runs(tmp_path / "runs")
    found, _ = collect_runs([root], metric="headline")
    assert {r.name: r.headline for r in found} == {
        "feddap-0": "last5", "feddap-1": "last5", "fedproto-0": "final", "fedproto-1": "final",
    }  # fmt: skip
    table = aggregate(found, by=["method"], metric="headline")
    assert [(g.key, g.metric) for g in table.groups] == [
        (("feddap",), "last5"),
        (("fedproto",), "final"),
    ]
    cells = {g.key[0]: g.cells for g in table.groups}
    # FedDAP's cells: the mean of its last 5 rounds (2..6), then over its two seeds
    last5_a = np.mean([0.1 * i for i in range(2, 7)]) + 0.11
    assert cells["feddap"]["A"].mean == pytest.approx(last5_a)
    # FedProto's cells: the final round (6)
    assert cells["fedproto"]["A"].mean == pytest.approx(0.6 + 0.01)
    md = format_table(table, "md").splitlines()
    assert md[0] == "| method | metric | n | A | B | AVG | STD |"
    assert md[2].startswith("| feddap | last5 | 2 | 51.00 ± 1.41 |")
    assert md[3].startswith("| fedproto | final | 2 | 61.00 ± 1.41 |")
    # best is ranked among rows of the same metric only: each row is alone in its metric
    assert "**" not in "\n".join(md)
    csv_lines = format_table(table, "csv").splitlines()
    assert csv_lines[0].startswith("method,metric,n,A_mean,")
    assert csv_lines[1].startswith("feddap,last5,2,51.0000,")
    assert r"feddap & last5 & 2" in format_table(table, "latex")
    assert '<td class="key">last5</td>' in format_table(table, "html")


def test_forced_metric_applies_to_every_run_and_hides_the_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _headline_runs(tmp_path / "runs")
    for metric, feddap_a in (
        ("final", 0.71),
        ("last5", np.mean([0.1 * i for i in range(2, 7)]) + 0.11),
    ):
        args = _parse(["table", str(root), "--by", "method", "--metric", metric, "--caption"])
        assert args.func(args) == 0
        out, err = capsys.readouterr()
        lines = out.splitlines()
        assert lines[0] == "| method | n | A | B | AVG | STD |"  # one metric: no column
        # forced: ranked across every row (here FedDAP's are best)
        assert lines[2].startswith(f"| feddap | 2 | **{100 * feddap_a:.2f} ± 1.41** |")
        assert ("final round" if metric == "final" else "mean of the last 5 rounds") in err
    args = _parse(["table", str(root), "--by", "method", "--caption"])  # the default: headline
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "| method | metric | n | A | B | AVG | STD |"
    assert "each run's headline" in err
    with pytest.raises(SystemExit):
        _parse(["table", str(root), "--metric", "best"])


def test_rows_never_mix_metrics_and_best_is_ranked_within_a_metric(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    # one method, two headlines: two rows, not one averaging a final round with a last-5 mean
    rows = [{"A": 0.1 * i, "B": 0.1 * i} for i in range(1, 7)]
    make_run(root, "a", method="fedproto", mechanism="none", seed=0, acc=rows[-1], rows=rows)
    make_run(root, "b", method="fedproto", mechanism="none", seed=1, acc=rows[-1], rows=rows,
             headline="last5")  # fmt: skip
    make_run(root, "c", method="fpl", mechanism="none", seed=0, acc={"A": 0.5, "B": 0.5},
             headline="final")  # fmt: skip
    found, _ = collect_runs([root], metric="headline")
    table = aggregate(found, by=["method"], metric="headline")
    assert [(g.key[0], g.metric, len(g.runs)) for g in table.groups] == [
        ("fedproto", "final", 1), ("fedproto", "last5", 1), ("fpl", "final", 1),
    ]  # fmt: skip
    # AVG: fedproto/final 60 beats fpl/final 50; fedproto/last5 (40) is not ranked against them
    assert table.best("AVG") == {0}


def test_headline_falls_back_to_the_config_then_final(tmp_path: Path) -> None:
    rows = [{"A": 0.1 * i, "B": 0.1 * i} for i in range(1, 7)]
    old = make_run(tmp_path, "old", method="fedproto", mechanism="none", seed=0, acc=rows[-1],
                   rows=rows, headline="last5", record_headline=False)  # fmt: skip
    rec = load_run(old)
    assert "headline" not in rec.summary and rec.headline == "last5"  # from config.yaml
    assert rec.scores("headline") == rec.scores("last5")
    bare = make_run(tmp_path, "bare", method="fedproto", mechanism="none", seed=0, acc=rows[-1],
                    rows=rows)  # fmt: skip
    assert load_run(bare).headline == "final"
    with pytest.raises(
        ValueError, match="metric 'best' is unknown; choose one of: headline, final, last5"
    ):
        rec.scores("best")
    with pytest.raises(ValueError, match="metric 'best' is unknown"):
        aggregate([rec], metric="best")


# ----- issue 43: rows group by what ran -------------------------------------------------------
def test_extended_run_row_shows_rounds_run_and_epsilon_spent_and_is_marked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from protofl.engine.runner import extend_experiment, run_experiment
    from protofl.methods.checks import tiny_config

    out = tmp_path / "runs"
    for seed in (0, 1):
        config = tiny_config("fedproto", "igpp", rounds=2, seed=seed).with_overrides(
            ["privacy.epsilon=2", "federation.local_epochs=1"]
        )
        run_dir = run_experiment(config, out=out, progress=False).run_dir
        if seed == 0:
            extend_experiment(run_dir, 2, progress=False)
    found, skipped = collect_runs([out])
    assert len(found) == 2 and skipped == []  # the .client-local folders are not runs
    # today's main: one row averaging both runs, showing the config's epsilon 2 and rounds 2
    table = aggregate(found, metric="final")  # the default keys: what differs among the runs
    assert table.by == ["federation.rounds", "privacy.epsilon"]
    assert [(g.key, len(g.runs)) for g in table.groups] == [((4, 2.954), 1), ((2, 2.0), 1)]
    assert [g.extended for g in table.groups] == [True, False]
    md = format_table(table, "md").splitlines()
    assert md[0].startswith("| rounds | epsilon | extended | n |")
    assert md[2].startswith("| 4 | 2.954 | yes | 1 |") and md[3].startswith("| 2 | 2 | no | 1 |")
    extended = next(r for r in found if r.extended)
    spent = max(extended.summary["privacy"]["epsilon_spent"].values())
    assert spent > 2.9 and extended.summary["rounds"] == 4
    assert extended.value("epsilon") == pytest.approx(spent, abs=1e-3)  # what ran
    assert extended.value("epsilon") >= spent  # rounded up, never understated
    assert extended.value("rounds") == 4
    assert extended.value("configured_epsilon") == 2.0
    assert extended.value("configured_rounds") == 2

    args = _parse(
        ["table", str(out), "--by", "epsilon,rounds,configured_epsilon,configured_rounds",
         "--metric", "final", "--format", "csv"]
    )  # fmt: skip
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("epsilon,rounds,configured epsilon,configured rounds,extended,n,")
    assert lines[1].startswith("2.954,4,2,2,yes,1,") and lines[2].startswith("2,2,2,2,no,1,")
    # --where reads what ran too; configured_epsilon what was asked for
    assert [r.extended for r in filter_runs_(found, "epsilon=2")] == [False]
    assert len(filter_runs_(found, "configured_epsilon=2")) == 2


def filter_runs_(runs: list[Any], where: str) -> list[Any]:
    from protofl.report.tables import filter_runs

    return filter_runs(runs, [where])


def test_flower_and_sim_runs_are_not_averaged_together(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root, "sim", method="fedproto", mechanism="vpdr", seed=0, acc={"A": 0.8, "B": 0.6})
    flower = make_run(
        root, "flower", method="fedproto", mechanism="vpdr", seed=0, acc={"A": 0.4, "B": 0.2}
    )
    summary = json.loads((flower / "summary.json").read_text())
    (flower / "summary.json").write_text(json.dumps({**summary, "engine": "flower"}))
    found, _ = collect_runs([root])
    table = aggregate(found, by=["method", "mechanism"])
    assert [len(g.runs) for g in table.groups] == [1, 1]  # today's main: one row of 2
    assert [g.engine for g in table.groups] == ["flower", "sim"]
    assert {r.name: r.engine for r in found} == {"flower": "flower", "sim": "sim"}
    md = format_table(table, "md").splitlines()
    assert md[0] == "| method | mechanism | engine | n | A | B | AVG | STD |"
    assert md[2].startswith("| fedproto | vpdr | flower | 1 | 40.00 |")
    assert md[3].startswith("| fedproto | vpdr | sim | 1 | **80.00** |")
    # grouping by the engine names it as a key, not twice
    by_engine = format_table(aggregate(found, by=["engine"]), "md").splitlines()
    assert by_engine[0] == "| engine | n | A | B | AVG | STD |"


def test_a_folder_of_runs_descends_into_sweep_subfolders(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = runs / "sweep-a"
    sweep.mkdir()
    for name in ("s2", "s1"):
        make_run(sweep, name, method="fpl", mechanism="none", seed=int(name[1]),
                 acc={"A": 0.5, "B": 0.5})  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps({"runs": [{"dir": "s2"}, {"dir": "s1"}]}))
    grouped = runs / "more"  # a plain folder of runs below the runs folder
    make_run(grouped, "g1", method="fpl", mechanism="none", seed=3, acc={"A": 0.5, "B": 0.5})
    local = runs / "r1.client-local"  # a run's local-only folder is not a run
    local.mkdir()
    (local / "diagnostics.jsonl").write_text("")
    (local / "config.yaml").write_text("seed: 0\n")
    found, skipped = collect_runs([runs])
    assert [r.name for r in found] == ["g1", "r1", "r2", "r3", "r4", "r5", "s2", "s1"]
    assert [p.name for p, _ in skipped] == ["stopped"]
    # a folder holding only sweep folders is a folder of runs too
    only = runs.parent / "only-sweeps"
    only.mkdir()
    sweep.rename(only / "sweep-a")
    args = _parse(["table", str(only), "--by", "method,seed", "--metric", "final"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[1] for line in out[2:]] == ["2", "1"]  # grid order
