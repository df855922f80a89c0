"""``protofl report``: a self-contained ``report.html`` and a ``report.md`` for a run or a sweep.

The HTML embeds every figure as a base64 PNG and carries its CSS inline: no scripts, no external
resources, so it can be mailed or archived as one file.  The Markdown links the same figures
from ``figures/`` (PNG and SVG are both written there).
"""

from __future__ import annotations

import base64
import html
import importlib.metadata
import json
import logging
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from protofl.report import plots
from protofl.report.tables import (
    AVG,
    EPSILON_DIGITS,
    STD,
    NotARun,
    ResultTable,
    RunRecord,
    aggregate,
    ceil_significant,
    collect_runs,
    default_by,
    display_key,
    format_table,
    format_value,
    load_run,
)

log = logging.getLogger(__name__)

PACKAGES = (
    "protofl",
    "torch",
    "numpy",
    "scipy",
    "scikit-learn",
    "matplotlib",
    "dp-accounting",
    "rich",
    "PyYAML",
)


# --------------------------------------------------------------------------------------------
# a tiny document model rendered to both HTML and Markdown
# --------------------------------------------------------------------------------------------
@dataclass
class Doc:
    """Blocks of a report, in order."""

    title: str
    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h2(self, text: str) -> None:
        """A section heading."""
        self.blocks.append(("h2", text))

    def h3(self, text: str) -> None:
        """A sub-heading."""
        self.blocks.append(("h3", text))

    def p(self, text: str) -> None:
        """A paragraph (plain text)."""
        self.blocks.append(("p", text))

    def table(self, table: ResultTable) -> None:
        """An aggregated result table."""
        self.blocks.append(("table", table))

    def rows(self, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A plain table of strings."""
        self.blocks.append(("rows", (list(headers), [[str(c) for c in r] for r in rows])))

    def figure(self, png: Path, caption: str) -> None:
        """A figure (PNG path)."""
        self.blocks.append(("figure", (png, caption)))

    def pre(self, text: str, lang: str = "") -> None:
        """Preformatted text (config YAML, tracebacks)."""
        self.blocks.append(("pre", (text, lang)))


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:72em;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;border-bottom:2px solid #444;padding-bottom:.2em}
h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ccc}
h3{font-size:1.05em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .55em}
th{background:#f2f2f2}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.key{text-align:left}
figure{margin:1em 0}
figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.85em;color:#555}
pre{background:#f7f7f7;border:1px solid #ddd;padding:.7em;overflow:auto;font-size:.82em}
.note{color:#555;font-size:.9em}
""".strip()


def render_html(doc: Doc) -> str:
    """The self-contained HTML page."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(doc.title)}</title>",
        f"<style>{CSS}</style>",
        "</head><body>",
        f"<h1>{html.escape(doc.title)}</h1>",
    ]
    for kind, value in doc.blocks:
        if kind in ("h2", "h3"):
            out.append(f"<{kind}>{html.escape(value)}</{kind}>")
        elif kind == "p":
            out.append(f'<p class="note">{html.escape(value)}</p>')
        elif kind == "table":
            out.append(format_table(value, "html"))
        elif kind == "rows":
            headers, rows = value
            out.append('<table class="plain">')
            if any(headers):  # never an empty header row
                out.append(
                    "<thead><tr>"
                    + "".join(f"<th>{html.escape(h)}</th>" for h in headers)
                    + "</tr></thead>"
                )
            out.append("<tbody>")
            for r in rows:
                out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
            out.append("</tbody></table>")
        elif kind == "figure":
            png, caption = value
            data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
            out.append(
                f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
        elif kind == "pre":
            text, _ = value
            out.append(f"<pre>{html.escape(text)}</pre>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: Doc, base: Path) -> str:
    """The Markdown version (figures linked relative to ``base``)."""
    out = [f"# {doc.title}", ""]
    for kind, value in doc.blocks:
        if kind == "h2":
            out += [f"## {value}", ""]
        elif kind == "h3":
            out += [f"### {value}", ""]
        elif kind == "p":
            out += [value, ""]
        elif kind == "table":
            out += [format_table(value, "md").rstrip("\n"), ""]
        elif kind == "rows":
            headers, rows = value
            out.append("| " + " | ".join(_md_escape(h) for h in headers) + " |")
            out.append("|" + "|".join("---" for _ in headers) + "|")
            out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
            out.append("")
        elif kind == "figure":
            png, caption = value
            rel = Path(png).relative_to(base) if Path(png).is_relative_to(base) else Path(png)
            svg = rel.with_suffix(".svg")
            out += [
                f"![{caption}]({rel.as_posix()})",
                "",
                f"*{caption}* ([SVG]({svg.as_posix()}))",
                "",
            ]
        elif kind == "pre":
            text, lang = value
            out += [f"```{lang}", text.rstrip("\n"), "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------
def report_environment() -> dict[str, str]:
    """Versions of Python, the platform and the packages that made the report."""
    env = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = "not installed"
    return env


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


def _try_figure(
    doc: Doc, draw: Callable[[], list[Path]], caption: str, notes: list[str], what: str
) -> None:
    from protofl.progress import step

    try:
        with step(f"figure: {what}"):
            paths = draw()
    except Exception as exc:  # one bad figure must not cost the whole report
        log.info("figure %s not drawn: %s", what, exc)
        notes.append(f"{what}: not drawn ({type(exc).__name__}: {exc})")
        return
    doc.figure(paths[0], caption)


def _privacy_section(doc: Doc, rec: RunRecord) -> None:
    priv = dict(rec.summary.get("privacy") or {})
    spent = priv.pop("epsilon_spent", None)
    guarantee = priv.pop("guarantee", None)
    if isinstance(guarantee, dict) and guarantee.get("statement"):
        doc.h3("What the guarantee covers (per client)")
        doc.p(str(guarantee["statement"]))
        rows = [[k, _fmt(guarantee[k])] for k in ("noise_key", "noise_key_note") if k in guarantee]
        rows += [["not covered", str(g)] for g in guarantee.get("not_covered", [])]
        rows += [["outside scope", str(g)] for g in guarantee.get("outside_scope", [])]
        doc.rows(["aspect", "detail"], rows)
    doc.rows(["key", "value"], [[k, _fmt(v)] for k, v in priv.items()])
    if isinstance(spent, dict) and spent:
        doc.h3("Privacy ledger: epsilon spent per client (whole run)")
        doc.rows(
            ["client", "ε spent", "δ"],
            [
                [c, "-" if v is None else f"{float(v):.4f}", _fmt(priv.get("delta", "-"))]
                for c, v in spent.items()
            ],
        )


def _env_section(doc: Doc, runs: Sequence[RunRecord]) -> None:
    doc.h2("Environment and versions")
    envs: list[dict[str, Any]] = []
    for r in runs:
        e = r.summary.get("environment")
        if isinstance(e, dict) and e not in envs:
            envs.append(e)
    if envs:
        keys = list(dict.fromkeys(k for e in envs for k in e))
        doc.h3("Recorded by the run(s)")
        doc.rows(
            ["key"] + [f"#{i + 1}" for i in range(len(envs))],
            [[k] + [_fmt(e.get(k, "-")) for e in envs] for k in keys],
        )
    doc.h3("Report generated with")
    doc.rows(["package", "version"], list(report_environment().items()))


def _files_section(doc: Doc, folder: Path) -> None:
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    doc.h2("Files in this folder")
    doc.p(", ".join(names))


COUNT_METRICS = ("mia_members", "mia_nonmembers")
"""Attack results that count examples: shown as whole numbers (their total over clients)."""


def attack_rows(rec: RunRecord, metrics: dict[str, float]) -> list[list[str]]:
    """``[metric, value]`` rows of the attack table: rates to 4 decimals, example counts as
    integers (the total over clients when the attack file lists them; else the mean, rounded)."""
    rows = []
    for k, v in metrics.items():
        if k not in COUNT_METRICS:
            rows.append([k, f"{v:.4f}"])
            continue
        kind = k.split("_", 1)[0]
        clients = (rec.attack(kind) or {}).get("clients")
        counts = [
            c.get(k)
            for c in (clients.values() if isinstance(clients, dict) else [])
            if isinstance(c, dict)
        ]
        numbers = [
            float(c) for c in counts if isinstance(c, int | float) and not isinstance(c, bool)
        ]
        if numbers and len(numbers) == len(counts):
            rows.append([f"{k} (total over {len(numbers)} clients)", f"{round(sum(numbers)):d}"])
        else:
            rows.append([f"{k} (mean per client)", f"{round(v):d}"])
    return rows


def _single_row_table(rec: RunRecord, metric: str) -> ResultTable:
    return aggregate([rec], by=[], metric=metric)


# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------
def _run_doc(
    rec: RunRecord, figdir: Path, *, tsne: bool, tsne_points: int, home: Path | None
) -> Doc:
    s = rec.summary
    doc = Doc(title=f"protofl report: {rec.name}")
    extended = (
        f" (EXTENDED from the configured {rec.value('configured_rounds')} with protofl extend, "
        f"at the noise calibrated for ε={format_value('epsilon', rec.value('configured_epsilon'))}"
        f"; ε spent {format_value('epsilon', rec.value('epsilon'))})"
        if rec.extended
        else ""
    )
    doc.p(
        f"Run folder {rec.path}; method {rec.value('method')}, privacy mechanism "
        f"{rec.value('mechanism')}, data set {s.get('dataset', rec.value('dataset'))}, "
        f"{s.get('rounds')} rounds{extended}, engine {rec.engine}, seed {rec.value('seed')}; "
        f"report generated {datetime.now().isoformat(timespec='seconds')}."
    )
    notes: list[str] = []
    doc.h2("Accuracy")
    doc.h3("Final round")
    doc.table(_single_row_table(rec, "final"))
    if rec.metrics:
        doc.h3(f"Mean of the last {min(5, len(rec.metrics))} rounds")
        doc.table(_single_row_table(rec, "last5"))
    doc.p("Accuracy in %; AVG = mean over domains; STD = standard deviation over domains.")
    client_acc = s.get("client_acc") or {}
    if len(client_acc) > len(s.get("acc", {})):
        doc.h3("Per client (final round)")
        doc.rows(["client", "accuracy (%)"], [[c, f"{100 * v:.2f}"] for c, v in client_acc.items()])
    doc.h2("Figures")
    _try_figure(
        doc,
        lambda: plots.plot_accuracy(rec, figdir / "accuracy"),
        "Test accuracy per round per domain (AVG in black).",
        notes,
        "accuracy per round",
    )
    if plots.epsilon_per_round(rec):
        _try_figure(
            doc,
            lambda: plots.plot_epsilon(rec, figdir / "epsilon"),
            "Privacy spent: largest ε over clients after each round.",
            notes,
            "epsilon per round",
        )
    if plots.has_feature_norms(rec):
        _try_figure(
            doc,
            lambda: plots.plot_feature_norms([rec], figdir / "feature_norms"),
            "Pre-clipping norm of the uploaded features per round, with the clipping threshold.",
            notes,
            "feature norms",
        )
    else:
        notes.append(
            "feature norms: the run did not record feature_norms (or its client-local folder "
            "was not kept beside it)"
        )
    if tsne and plots.client_model_file(rec.path) is not None:
        _try_figure(
            doc,
            lambda: plots.plot_tsne(rec, figdir / "tsne", max_points=tsne_points, home=home),
            "t-SNE of the final client models' features on their test data.",
            notes,
            "t-SNE",
        )
    if notes:
        doc.p("Not shown: " + "; ".join(notes) + ".")
    attacks = plots.attack_metrics(rec)
    if attacks:
        doc.h2("Attacks (mean over clients)")
        doc.rows(["metric", "value"], attack_rows(rec, attacks))
    doc.h2("Privacy")
    _privacy_section(doc, rec)
    doc.h2("Resolved config")
    doc.pre(yaml.safe_dump(rec.config, sort_keys=False), "yaml")
    _env_section(doc, [rec])
    _files_section(doc, rec.path)
    return doc


# --------------------------------------------------------------------------------------------
# a sweep or a folder of runs
# --------------------------------------------------------------------------------------------
def _group_label(by: Sequence[str], run: RunRecord) -> str:
    """A row's name in figures; a Flower run and an extended run are named so (they never share
    a row with simulator runs and runs that were not extended)."""
    label = (
        ", ".join(f"{display_key(k)}={format_value(k, run.value(k))}" for k in by)
        if by
        else str(run.value("method"))
    )
    if run.engine != "sim" and "engine" not in by:
        label += f" [{run.engine}]"
    if run.extended and "extended" not in by:
        label += " (extended)"
    return label


def _many_doc(
    folder: Path,
    runs: list[RunRecord],
    skipped: list[tuple[Path, str]],
    figdir: Path,
    *,
    by: Sequence[str] | None,
    metric: str,
) -> Doc:
    status: dict[str, Any] = {}
    if (folder / "sweep.json").exists():
        status = json.loads((folder / "sweep.json").read_text())
    title = (
        f"protofl report: sweep {status['name']}" if status else f"protofl report: {folder.name}"
    )
    doc = Doc(title=title)
    keys = list(by) if by is not None else default_by(runs)
    doc.p(
        f"Folder {folder}; {len(runs)} finished runs"
        + (f", {len(skipped)} folders skipped" if skipped else "")
        + f"; report generated {datetime.now().isoformat(timespec='seconds')}."
    )
    notes: list[str] = []
    doc.h2("Results")
    if runs:
        for m, heading in (
            ("final", "Final round"),
            ("last5", "Mean of the last 5 rounds (all rounds when fewer)"),
        ):
            try:
                table = aggregate(runs, keys, m)
            except (NotARun, KeyError, ValueError) as exc:
                notes.append(f"{heading}: {exc}")
                continue
            doc.h3(heading)
            doc.table(table)
        doc.p(
            "Accuracy in %; AVG = mean over domains, STD = standard deviation over domains; "
            "mean ± sample std over the runs of a row (n runs, e.g. seeds); best per column in "
            "bold (STD: lowest)."
        )
    else:
        doc.p("No finished runs yet.")
    if runs:
        doc.h2("Figures")
        groups: dict[str, list[RunRecord]] = {}
        for r in runs:
            groups.setdefault(_group_label(keys, r), []).append(r)
        _try_figure(
            doc,
            lambda: plots.plot_avg_per_round(groups, figdir / "avg_per_round"),
            "AVG accuracy per round per row of the table (mean over runs; band = min..max).",
            notes,
            "AVG per round",
        )
        if any(r.value("mechanism") != "none" for r in runs):
            _try_figure(
                doc,
                lambda: plots.plot_privacy_utility(runs, figdir / "privacy_utility", metric),
                plots.privacy_utility_caption(runs),
                notes,
                "privacy-utility",
            )
        with_norms = [r for r in runs if plots.has_feature_norms(r)]
        if with_norms:
            firsts = list({_group_label(keys, r): r for r in reversed(with_norms)}.values())[::-1]
            _try_figure(
                doc,
                lambda: plots.plot_feature_norms(firsts[:4], figdir / "feature_norms"),
                "Pre-clipping feature norms per round with the clipping threshold (first run of "
                "up to 4 rows).",
                notes,
                "feature norms",
            )
        if any(plots.attack_metrics(r) for r in runs):
            _try_figure(
                doc,
                lambda: plots.plot_attacks(runs, figdir / "attacks"),
                "Attack metrics against ε (mean over clients, then over seeds).",
                notes,
                "attacks",
            )
        if notes:
            doc.p("Not shown: " + "; ".join(notes) + ".")
    doc.h2("Runs")
    rows = []
    marks = any(r.extended for r in runs)
    for r in runs:
        sc = r.scores("final")
        eps = r.epsilon_spent()
        wall = r.summary.get("wall_s")
        rows.append(
            [
                r.name,
                *[format_value(k, r.value(k)) for k in keys],
                str(r.value("seed")),
                f"{100 * sc[AVG]:.2f}",
                f"{100 * sc[STD]:.2f}",
                "-" if eps is None else f"{ceil_significant(eps, EPSILON_DIGITS):g}",
                "-" if wall is None else f"{float(wall):.1f}",
                *([("yes" if r.extended else "no")] if marks else []),
            ]
        )
    doc.rows(
        ["folder", *[display_key(k) for k in keys], "seed", "AVG", "STD", "ε spent", "wall s"]
        + (["extended"] if marks else []),
        rows,
    )
    if status:
        failed = [r for r in status.get("runs", []) if r.get("status") != "done"]
        counts = status.get("counts", {})
        doc.h3("Sweep status")
        doc.p(", ".join(f"{k}: {v}" for k, v in counts.items() if v) or "no runs")
        if failed:
            doc.rows(
                ["folder", "status", "error"],
                [[r["dir"], r.get("status", "?"), r.get("error") or ""] for r in failed],
            )
    if skipped:
        doc.h3("Skipped folders")
        doc.rows(["folder", "why"], [[str(p), why] for p, why in skipped])
    if runs:
        doc.h2("Privacy")
        mechs: dict[tuple[Any, ...], RunRecord] = {}
        for r in runs:
            mechs.setdefault(
                (r.value("mechanism"), r.value("configured_epsilon"), r.value("dcr")), r
            )
        prow = []
        for (mech, eps, dcr), r in mechs.items():
            p = r.summary.get("privacy") or {}
            prow.append(
                [
                    str(mech),
                    format_value("epsilon", eps),
                    str(p.get("delta", "-")),
                    _fmt(p.get("sigma", "-")),
                    str(dcr),
                    str(r.value("privacy.accountant")),
                ]
            )
        doc.rows(["mechanism", "ε configured", "δ", "σ", "DCR", "accountant"], prow)
    doc.h2("Config")
    if status:
        doc.h3("Sweep grid")
        doc.pre(yaml.safe_dump({"grid": status.get("grid", {})}, sort_keys=False), "yaml")
        doc.h3("Base config")
        doc.pre(yaml.safe_dump(status.get("base", {}), sort_keys=False), "yaml")
    if runs:
        doc.h3(f"Resolved config of the first run ({runs[0].name})")
        doc.pre(yaml.safe_dump(runs[0].config, sort_keys=False), "yaml")
    _env_section(doc, runs)
    return doc


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------
def write_report(
    folder: str | Path,
    *,
    by: Sequence[str] | None = None,
    metric: str = "final",
    tsne: bool = True,
    tsne_points: int = 1000,
    home: Path | None = None,
) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` (and ``figures/``) into a run or sweep folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    figdir = folder / "figures"
    try:
        rec = load_run(folder)
    except NotARun:
        runs, skipped = collect_runs([folder], metric="final")
        if not runs and not (folder / "sweep.json").exists():
            listed = "; ".join(f"{p}: {why}" for p, why in skipped[:5])
            raise ValueError(
                f"{folder} is neither a finished run nor a folder of runs"
                + (f" ({listed})" if listed else "")
            ) from None
        doc = _many_doc(folder, runs, skipped, figdir, by=by, metric=metric)
    else:
        doc = _run_doc(rec, figdir, tsne=tsne, tsne_points=tsne_points, home=home)
    html_path = folder / "report.html"
    md_path = folder / "report.md"
    html_path.write_text(render_html(doc), encoding="utf-8")
    md_path.write_text(render_markdown(doc, folder), encoding="utf-8")
    return html_path, md_path
