"""Figures (PNG and SVG) from run folders: accuracy per round, privacy-utility, feature norms,
t-SNE of client features, attack metrics against epsilon.

Figures are drawn on :class:`matplotlib.figure.Figure` objects with the Agg canvas, never through
``pyplot``, so importing this module changes no global matplotlib state and works headless.
Every ``plot_*`` function takes an output *stem* (``figures/accuracy``) and returns the written
paths (``figures/accuracy.png``, ``figures/accuracy.svg``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from protofl.engine.norms import QUANTILES, feature_norm_stats
from protofl.report.tables import RunRecord, load_run

__all__ = ["QUANTILES", "feature_norm_stats"]
PREFERRED_ATTACK_METRICS = ("mia_auc", "mia_cal_auc", "mia_advantage", "mia_cal_advantage")


def _figure(width: float = 6.4, height: float = 4.0) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Any, stem: str | Path, *, dpi: int = 120) -> list[Path]:
    """Write ``<stem>.png`` and ``<stem>.svg`` (deterministic metadata); returns both paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    png = stem.with_name(stem.name + ".png")
    svg = stem.with_name(stem.name + ".svg")
    fig.savefig(png, dpi=dpi, metadata={"Software": None})
    import matplotlib

    with matplotlib.rc_context({"svg.hashsalt": "protofl"}):
        fig.savefig(svg, metadata={"Date": None, "Creator": None})
    return [png, svg]


def _integer_rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def _as_record(run: RunRecord | str | Path) -> RunRecord:
    return run if isinstance(run, RunRecord) else load_run(run)


def _label(run: RunRecord) -> str:
    return f"{run.value('method')} · {run.value('mechanism')}"


# --------------------------------------------------------------------------------------------
# accuracy per round
# --------------------------------------------------------------------------------------------
def plot_accuracy(run: RunRecord | str | Path, stem: str | Path) -> list[Path]:
    """Test accuracy per round of every domain, with AVG in bold (one run)."""
    rec = _as_record(run)
    rows = rec.metrics
    if not rows:
        raise ValueError(f"{rec.path}: no metrics.jsonl rows to plot")
    fig = _figure()
    ax = fig.add_subplot()
    rounds = [r["round"] for r in rows]
    domains = list(rows[-1]["acc"])
    for d in domains:
        ax.plot(rounds, [100 * r["acc"].get(d, math.nan) for r in rows], label=d, lw=1.2)
    ax.plot(rounds, [100 * r["avg_acc"] for r in rows], label="AVG", color="black", lw=2.4)
    if any(r.get("holdout_acc") is not None for r in rows):
        ax.plot(
            rounds,
            [100 * (r.get("holdout_acc") or math.nan) for r in rows],
            label="held-out",
            color="grey",
            ls="--",
        )
    _integer_rounds(ax)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{_label(rec)} on {rec.summary.get('dataset', rec.value('dataset'))}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncols=2)
    return save_figure(fig, stem)


def plot_avg_per_round(
    groups: Mapping[str, Sequence[RunRecord]], stem: str | Path, title: str = ""
) -> list[Path]:
    """AVG accuracy per round, one line per group (mean over its runs, band = min..max)."""
    fig = _figure()
    ax = fig.add_subplot()
    for label, runs in groups.items():
        series = [[100 * r["avg_acc"] for r in run.metrics] for run in runs if run.metrics]
        if not series:
            continue
        n = min(len(s) for s in series)
        arr = np.asarray([s[:n] for s in series])
        x = np.arange(1, n + 1)
        (line,) = ax.plot(x, arr.mean(axis=0), label=label, lw=1.5)
        if len(series) > 1:
            ax.fill_between(x, arr.min(axis=0), arr.max(axis=0), color=line.get_color(), alpha=0.15)
    _integer_rounds(ax)
    ax.set_ylabel("AVG test accuracy (%)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(groups) <= 16:
        ax.legend(fontsize="x-small", ncols=2)
    return save_figure(fig, stem)


# --------------------------------------------------------------------------------------------
# privacy-utility
# --------------------------------------------------------------------------------------------
def _by(runs: Sequence[RunRecord], *keys: str) -> dict[tuple[Any, ...], list[RunRecord]]:
    out: dict[tuple[Any, ...], list[RunRecord]] = {}
    for r in runs:
        out.setdefault(tuple(r.value(k) for k in keys), []).append(r)
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def _epsilon_axis(ax: Any, eps_values: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(eps_values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{e:g}" for e in ticks])
    ax.minorticks_off()
    ax.set_xlabel("ε (per client, whole run)")


def privacy_utility_caption(runs: Sequence[RunRecord]) -> str:
    """The caption of :func:`plot_privacy_utility` for these runs: it names the dashed 'no
    privacy' line only when the figure draws one (a run without a privacy mechanism)."""
    text = (
        "Privacy-utility: AVG accuracy against the ε spent (largest over clients, whole run) "
        "per mechanism, one panel per method (mean ± std over seeds)"
    )
    if any(r.value("mechanism") == "none" for r in runs):
        text += "; dashed black line: no privacy (mean, band ± std)"
    return text + "."


def plot_privacy_utility(
    runs: Sequence[RunRecord], stem: str | Path, metric: str = "final"
) -> list[Path]:
    """AVG accuracy against the epsilon spent, one line per mechanism (mean ± std over seeds),
    with the 'no privacy' runs as a dashed reference; one panel per method when there are
    several (:func:`privacy_utility_caption` says what is drawn)."""
    runs = [_as_record(r) for r in runs]
    methods = list(dict.fromkeys(str(r.value("method")) for r in runs))
    fig = _figure(5.2 * len(methods), 4.0)
    axes = fig.subplots(1, len(methods), sharey=True, squeeze=False)[0]
    private = [r for r in runs if r.value("mechanism") != "none"]
    if not private:
        raise ValueError("privacy-utility needs runs with a privacy mechanism (none found)")
    for ax, method in zip(axes, methods):
        mine = [r for r in runs if str(r.value("method")) == method]
        eps_seen: list[float] = []
        for (mech,), group in _by(
            [r for r in mine if r.value("mechanism") != "none"], "mechanism"
        ).items():
            points = sorted(_by(group, "epsilon").items(), key=lambda kv: float(kv[0][0]))
            xs = [float(e) for (e,), _ in points]
            stats = [_mean_std([100 * r.scores(metric)["AVG"] for r in g]) for _, g in points]
            ax.errorbar(
                xs,
                [m for m, _ in stats],
                yerr=[s for _, s in stats],
                marker="o",
                capsize=3,
                label=str(mech),
            )
            eps_seen += xs
        ref = [100 * r.scores(metric)["AVG"] for r in mine if r.value("mechanism") == "none"]
        if ref:
            m, s = _mean_std(ref)
            ax.axhline(m, color="black", ls="--", lw=1.2, label="no privacy")
            if s > 0:
                ax.axhspan(m - s, m + s, color="black", alpha=0.08)
        if eps_seen:
            _epsilon_axis(ax, eps_seen)
        ax.set_title(method)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("AVG accuracy (%)" + (" (last 5 rounds)" if metric == "last5" else ""))
    return save_figure(fig, stem)


# --------------------------------------------------------------------------------------------
# feature norms
# --------------------------------------------------------------------------------------------
def _norm_rows(rec: RunRecord) -> list[tuple[int, list[Mapping[str, float]]]]:
    rows = []
    for r in rec.metrics:
        fn = r.get("feature_norms")
        if not isinstance(fn, Mapping) or not fn:
            continue
        stats = [fn] if "q50" in fn else [v for v in fn.values() if isinstance(v, Mapping)]
        stats = [s for s in stats if "q50" in s]
        if stats:
            rows.append((int(r["round"]), stats))
    return rows


def has_feature_norms(run: RunRecord) -> bool:
    """Whether the run recorded ``feature_norms`` (local-only: in its client-local
    ``diagnostics.jsonl``, or in ``metrics.jsonl`` of a run made before that split)."""
    return bool(_norm_rows(run))


def plot_feature_norms(
    runs: Sequence[RunRecord | str | Path], stem: str | Path, labels: Sequence[str] | None = None
) -> list[Path]:
    """Pre-clipping feature-norm distribution per round (median, 25-75 % and 5-95 % bands,
    averaged over clients) with the clipping threshold C; one panel per run (VPDR Fig. 4a)."""
    recs = [_as_record(r) for r in runs]
    recs = [r for r in recs if has_feature_norms(r)]
    if not recs:
        raise ValueError(
            "no run has feature_norms (per-round norm quantiles of the uploaded features, "
            "recorded by the engine in the run's client-local diagnostics.jsonl)"
        )
    fig = _figure(4.6 * len(recs), 3.8)
    axes = fig.subplots(1, len(recs), sharey=True, squeeze=False)[0]
    for i, (ax, rec) in enumerate(zip(axes, recs)):
        rows = _norm_rows(rec)
        x = [rnd for rnd, _ in rows]

        def q(key: str, rows: list[tuple[int, list[Mapping[str, float]]]] = rows) -> np.ndarray:
            return np.array([np.mean([s.get(key, math.nan) for s in st]) for _, st in rows])

        ax.fill_between(x, q("q05"), q("q95"), alpha=0.15, color="C0", label="5-95 %")
        ax.fill_between(x, q("q25"), q("q75"), alpha=0.35, color="C0", label="25-75 %")
        ax.plot(x, q("q50"), color="C0", lw=1.8, label="median")
        clip = rec.value("privacy.clip")
        if rec.value("mechanism") != "none" and isinstance(clip, int | float):
            ax.axhline(float(clip), color="C3", ls="--", label=f"clip C={clip:g}")
        title = labels[i] if labels and i < len(labels) else _label(rec)
        if (rec.summary.get("privacy") or {}).get("dcr") or rec.value("dcr"):
            title += " + DCR"
        ax.set_title(title)
        _integer_rounds(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("‖f‖₂ of uploaded features (before clipping)")
    return save_figure(fig, stem)


# --------------------------------------------------------------------------------------------
# t-SNE
# --------------------------------------------------------------------------------------------
def client_model_file(run_dir: Path) -> Path | None:
    """Where a run keeps its final client models: the client-local ``client-artifacts.pt``,
    or ``artifacts.pt`` of a run made before that split (None: nowhere)."""
    import torch

    from protofl.engine.rundir import CLIENT_ARTIFACTS, client_local_dir

    local = client_local_dir(run_dir) / CLIENT_ARTIFACTS
    if local.is_file():
        return local
    old = Path(run_dir) / "artifacts.pt"
    if old.is_file() and "models" in torch.load(old, map_location="cpu", weights_only=True):
        return old
    return None


def client_features(
    run: RunRecord | str | Path,
    *,
    split: str = "test",
    max_points: int = 1500,
    home: Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Features of the run's final client models on their own data (subsampled evenly over
    clients): ``{"features": [n, d], "labels", "domains" (ints), "clients", "class_names",
    "domain_names"}``.  Rebuilds the cached frozen features and loads the final client models
    from the run's client-local ``client-artifacts.pt`` (``artifacts.pt`` of an older run)."""
    import torch

    from protofl.config import ExperimentConfig
    from protofl.data.cache import protofl_home
    from protofl.engine.federated_data import build_federated_data
    from protofl.methods import create_method
    from protofl.models.backbones import backbone_class

    rec = _as_record(run)
    path = client_model_file(rec.path)
    if path is None:
        raise FileNotFoundError(
            f"{rec.path} has no saved client models (run.save_releases was off, or the run's "
            "client-local folder was not kept beside it)"
        )
    if split not in ("train", "test"):
        raise ValueError(f"split must be train or test, got {split!r}")
    config = ExperimentConfig.from_yaml(rec.path / "config.yaml")
    art = torch.load(path, map_location="cpu", weights_only=True)
    data = build_federated_data(config, home or protofl_home())
    if len(art["models"]) != len(data.clients):
        raise ValueError(
            f"{path} holds {len(art['models'])} client models; the config builds "
            f"{len(data.clients)} clients"
        )
    method = create_method(
        config.method.name,
        config.method.params,
        num_classes=data.num_classes,
        num_domains=len(data.domains),
        proto_dim=config.backbone.proto_dim,
        seed=config.seed,
    )
    backbone_cls = backbone_class(config.backbone)
    rng = np.random.default_rng(seed)
    per_client = max(1, max_points // max(1, len(data.clients)))
    feats, labels, domains, clients = [], [], [], []
    for cd, state in zip(data.clients, art["models"]):
        model = backbone_cls.client_model(
            data.feature_dim, data.num_classes, config.backbone, torch.Generator(), client=cd.client
        )
        model.load_state_dict(state)
        model.eval()
        z, y = (cd.test_z, cd.test_y) if split == "test" else (cd.train_z, cd.train_y)
        idx = np.sort(rng.choice(len(y), min(per_client, len(y)), replace=False))
        with torch.no_grad():
            f = method.upload_features(model, z[torch.from_numpy(idx)].float())  # type: ignore[arg-type]
        feats.append(f.float().numpy())
        labels.append(y[torch.from_numpy(idx)].numpy())
        domains.append(np.full(len(idx), cd.domain))
        clients.append(np.full(len(idx), cd.client))
    return {
        "features": np.concatenate(feats),
        "labels": np.concatenate(labels),
        "domains": np.concatenate(domains),
        "clients": np.concatenate(clients),
        "class_names": list(data.classes),
        "domain_names": list(data.domains),
    }


def plot_tsne(
    run: RunRecord | str | Path,
    stem: str | Path,
    *,
    split: str = "test",
    max_points: int = 1500,
    home: Path | None = None,
    seed: int = 0,
) -> list[Path]:
    """t-SNE (scikit-learn) of the final client models' features, coloured by class and by
    domain (two panels)."""
    from sklearn.manifold import TSNE

    rec = _as_record(run)
    data = client_features(rec, split=split, max_points=max_points, home=home, seed=seed)
    x = data["features"]
    n = len(x)
    if n < 5:
        raise ValueError(f"t-SNE needs at least 5 points, got {n}")
    emb = TSNE(
        n_components=2,
        perplexity=float(min(30.0, max(2.0, (n - 1) / 3))),
        init="pca",
        random_state=seed,
    ).fit_transform(x)
    fig = _figure(10.0, 4.6)
    ax_c, ax_d = fig.subplots(1, 2)
    for ax, key, names, title in (
        (ax_c, "labels", data["class_names"], "by class"),
        (ax_d, "domains", data["domain_names"], "by domain"),
    ):
        values = data[key]
        cmap = _colours(len(names))
        for k, name in enumerate(names):
            mask = values == k
            if mask.any():
                ax.scatter(emb[mask, 0], emb[mask, 1], s=6, color=cmap[k], label=str(name))
        ax.set_title(f"{title} ({split} features, {n} points)")
        ax.set_xticks([])
        ax.set_yticks([])
        if len(names) <= 20:
            ax.legend(fontsize="x-small", markerscale=2, ncols=1 + len(names) // 11, loc="best")
    fig.suptitle(f"t-SNE of client features: {_label(rec)}")
    return save_figure(fig, stem)


def _colours(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# --------------------------------------------------------------------------------------------
# attacks
# --------------------------------------------------------------------------------------------
def attack_metrics(run: RunRecord) -> dict[str, float]:
    """The mean-over-clients metrics of every ``attack_*.json`` in the run folder."""
    out: dict[str, float] = {}
    for kind in ("mia", "fsh"):
        data = run.attack(kind)
        if not data:
            continue
        for k, v in (data.get("mean") or {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out[k if k.startswith(kind) else f"{kind}_{k}"] = float(v)
    return out


def plot_attacks(
    runs: Sequence[RunRecord | str | Path], stem: str | Path, metrics: Sequence[str] | None = None
) -> list[Path]:
    """Attack metrics against epsilon (one panel per metric, one line per method·mechanism;
    runs without privacy as a dashed reference)."""
    recs = [_as_record(r) for r in runs]
    recs = [r for r in recs if attack_metrics(r)]
    if not recs:
        raise ValueError("no run folder holds attack results (attack_mia.json / attack_fsh.json)")
    available: list[str] = []
    for r in recs:
        available += [k for k in attack_metrics(r) if k not in available]
    if metrics is None:
        metrics = [m for m in PREFERRED_ATTACK_METRICS if m in available] or available[:3]
    metrics = [m for m in metrics if m in available]
    if not metrics:
        raise ValueError(f"none of the requested attack metrics exist; available: {available}")
    fig = _figure(4.4 * len(metrics), 3.8)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    lines = _by(recs, "method", "mechanism")
    for ax, metric in zip(axes, metrics):
        eps_seen: list[float] = []
        for (method, mech), group in lines.items():
            if mech == "none":
                vals = [attack_metrics(r)[metric] for r in group if metric in attack_metrics(r)]
                if vals:
                    ax.axhline(
                        float(np.mean(vals)), ls="--", color="black", lw=1, label=f"{method} · none"
                    )
                continue
            points = sorted(
                ((float(e), g) for (e,), g in _by(group, "epsilon").items() if e is not None),
                key=lambda kv: kv[0],
            )
            xs, ms, ss = [], [], []
            for e, g in points:
                vals = [attack_metrics(r)[metric] for r in g if metric in attack_metrics(r)]
                if vals:
                    m, s = _mean_std(vals)
                    xs.append(e)
                    ms.append(m)
                    ss.append(s)
            if xs:
                ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=f"{method} · {mech}")
                eps_seen += xs
        if "auc" in metric:
            ax.axhline(0.5, color="grey", ls=":", lw=1, label="chance")
        elif "advantage" in metric:
            ax.axhline(0.0, color="grey", ls=":", lw=1, label="chance")
        if eps_seen:
            _epsilon_axis(ax, eps_seen)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    return save_figure(fig, stem)


# --------------------------------------------------------------------------------------------
# privacy spent per round
# --------------------------------------------------------------------------------------------
def epsilon_per_round(run: RunRecord) -> list[tuple[int, float]]:
    """(round, largest epsilon spent over clients) for rounds that carry a guarantee."""
    out = []
    for r in run.metrics:
        eps = (r.get("privacy") or {}).get("epsilon_spent")
        if isinstance(eps, Mapping):
            vals = [float(v) for v in eps.values() if v is not None]
            if vals:
                out.append((int(r["round"]), max(vals)))
    return out


def plot_epsilon(run: RunRecord | str | Path, stem: str | Path) -> list[Path]:
    """Epsilon spent (max over clients) after each round, with the configured budget."""
    rec = _as_record(run)
    pts = epsilon_per_round(rec)
    if not pts:
        raise ValueError(f"{rec.path}: no epsilon was spent (no privacy mechanism)")
    fig = _figure(5.2, 3.4)
    ax = fig.add_subplot()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label="ε spent (max)")
    budget = rec.value("configured_epsilon")  # what the noise was calibrated for
    if isinstance(budget, int | float):
        ax.axhline(float(budget), color="C3", ls="--", label=f"budget ε={budget:g}")
    _integer_rounds(ax)
    ax.set_ylabel("ε")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, stem)
