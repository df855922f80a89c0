"""Console output: the paper-style per-domain accuracy table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table


def accuracy_table(summary: Mapping[str, Any], title: str | None = None) -> Table:
    """Domains, AVG and STD in percent (like the papers' Table 1)."""
    acc: Mapping[str, float] = summary["acc"]
    table = Table(title=title or f"{summary.get('method', '')} on {summary.get('dataset', '')}")
    for name in acc:
        table.add_column(name, justify="right")
    table.add_column("AVG", justify="right", style="bold")
    table.add_column("STD", justify="right")
    table.add_row(
        *[f"{100 * v:.2f}" for v in acc.values()],
        f"{100 * summary['avg_acc']:.2f}",
        f"{100 * summary['std_acc']:.2f}",
    )
    return table


def print_summary(summary: Mapping[str, Any], run_dir: str, console: Console | None = None) -> None:
    """Print the result table and where the run folder is."""
    console = console or Console()
    console.print(accuracy_table(summary))
    headline = summary.get("headline")
    if isinstance(headline, Mapping) and headline.get("metric") == "last5":
        console.print(f"headline AVG (mean of the last 5 rounds): {100 * headline['avg_acc']:.2f}")
    eps = summary.get("privacy", {}).get("epsilon_spent")
    if isinstance(eps, dict) and any(v is not None for v in eps.values()):
        worst = max(v for v in eps.values() if v is not None)
        console.print(
            f"privacy: max epsilon spent over clients = {worst:.3f} "
            f"(delta={summary['privacy'].get('delta')})"
        )
    guarantee = summary.get("privacy", {}).get("guarantee")
    if isinstance(guarantee, dict) and guarantee.get("statement"):
        console.print(f"guarantee: {guarantee['statement']}", markup=False)
    console.print(f"run folder: {run_dir}")
