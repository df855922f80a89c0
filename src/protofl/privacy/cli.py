"""``protofl privacy ...``: noise calibration, the sigma table, and the VPP partition measurement.

Wire into a top-level parser with ``add_privacy_parser(subparsers)``; the parsed namespace has
``func=run_privacy``.  Standalone: ``python -m protofl.privacy.cli privacy calibrate ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from protofl.privacy import igpp as _igpp  # noqa: F401  (registers igpp)
from protofl.privacy import vpp as _vpp  # noqa: F401  (registers vpp and vpdr)
from protofl.privacy.accounting import (
    ACCOUNTANTS,
    SPLITS,
    VPP_VARIANTS,
    calibrate_gaussian,
    calibrate_sampled,
    calibrate_vpp,
)
from protofl.privacy.base import create_mechanism, private_mechanisms
from protofl.privacy.config import PrivacyConfig


def add_privacy_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``privacy {calibrate,table,overlap}`` to an argparse subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "privacy", help="privacy calibration and measurements"
    )
    sub = parser.add_subparsers(dest="privacy_command", required=True)

    cal = sub.add_parser("calibrate", help="noise multiplier(s) for a budget")
    cal.add_argument("--mechanism", choices=private_mechanisms(), default="igpp")
    cal.add_argument("--epsilon", type=float, required=True)
    cal.add_argument("--delta", type=float, default=1e-5)
    cal.add_argument("--rounds", type=int, required=True)
    cal.add_argument("--accountant", choices=ACCOUNTANTS, default="pld")
    cal.add_argument("--split", choices=SPLITS, default="joint")
    cal.add_argument("--variant", choices=VPP_VARIANTS, default="paper")
    cal.add_argument("--rho", type=float, default=0.2)
    cal.add_argument("--ratio", type=float, default=0.1)
    cal.add_argument("--score-max", type=float, default=0.1, help="H, the score clip")
    cal.add_argument("--dim", type=int, default=512)
    cal.add_argument("--neighbouring", choices=("replace_one", "add_remove"), default="replace_one")
    cal.add_argument(
        "--sample-rate", type=float, default=1.0, help="Poisson subsampling q (add_remove, igpp)"
    )
    cal.add_argument("--json", action="store_true", help="print one JSON object")

    smp = sub.add_parser(
        "sampling", help="noise on a class mean with Poisson subsampling vs without (add_remove)"
    )
    smp.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    smp.add_argument("--rounds", type=int, nargs="+", default=[1, 20, 100])
    smp.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.3, 0.5, 1.0])
    smp.add_argument("--delta", type=float, default=1e-5)
    smp.add_argument("--accountant", choices=("pld", "rdp"), default="pld")
    smp.add_argument("--json", action="store_true")

    tab = sub.add_parser("table", help="sigma for several epsilons under every accountant")
    tab.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    tab.add_argument("--delta", type=float, default=1e-5)
    tab.add_argument("--rounds", type=int, default=20)
    tab.add_argument("--rho", type=float, default=0.2)
    tab.add_argument("--ratio", type=float, default=0.1)
    tab.add_argument("--dim", type=int, default=512)
    tab.add_argument("--json", action="store_true")

    ov = sub.add_parser(
        "overlap", help="VPP partition overlap and prototype accuracy on synthetic features"
    )
    ov.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    ov.add_argument("--delta", type=float, default=1e-5)
    ov.add_argument("--rounds", type=int, default=20)
    ov.add_argument("--variants", nargs="+", choices=VPP_VARIANTS, default=list(VPP_VARIANTS))
    ov.add_argument("--per-class", type=int, default=100, help="training samples per class")
    ov.add_argument("--classes", type=int, default=10)
    ov.add_argument("--dim", type=int, default=512)
    ov.add_argument("--informative", type=float, default=0.2, help="fraction of signal dims")
    ov.add_argument("--signal", type=float, default=0.5, help="class-mean std on signal dims")
    ov.add_argument("--seeds", type=int, default=3)
    ov.add_argument("--json", action="store_true")

    parser.set_defaults(func=run_privacy)
    return parser


def _calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """The registered mechanism's own calibration (:meth:`Mechanism.calibration`) for the
    budget and VPP settings on the command line."""
    config = PrivacyConfig(
        mechanism=args.mechanism,
        epsilon=args.epsilon,
        delta=args.delta,
        accountant=args.accountant,
        vpp_split=args.split,
        vpp_variant=args.variant,
        vpp_rho=args.rho,
        vpp_ratio=args.ratio,
        vpp_score_max=args.score_max,
        neighbouring=args.neighbouring,
        sample_rate=args.sample_rate,
    )
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds} is not allowed; choose an integer >= 1")
    mechanism = create_mechanism(config, rounds=args.rounds, dim=args.dim)
    out: dict[str, Any] = {
        "mechanism": args.mechanism,
        "accountant": args.accountant,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "rounds": args.rounds,
        "neighbouring": args.neighbouring,
    }
    if config.sampled:
        out["sample_rate"] = args.sample_rate
    out.update({k: v for k, v in mechanism.calibration().items() if k not in out})
    return out


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """Per (epsilon, T, q): the subsampled multiplier z_q and the noise it puts on a class mean
    with the fixed denominator q*n, z_q / q (in units of R/n), against the full-sample z_1."""
    rows = []
    for eps in args.epsilons:
        for t in args.rounds:
            full = calibrate_gaussian(eps, args.delta, t, args.accountant)
            for q in args.rates:
                z = calibrate_sampled(eps, args.delta, t, q, args.accountant)
                rows.append(
                    {
                        "epsilon": eps,
                        "rounds": t,
                        "sample_rate": q,
                        "sigma": z,
                        "noise_on_mean": z / q,
                        "full_sample_sigma": full,
                        "ratio": z / q / full,
                    }
                )
    return {"delta": args.delta, "accountant": args.accountant, "rows": rows}


def _print_sampling(res: dict[str, Any]) -> None:
    print(
        f"Poisson subsampling, add_remove, delta={res['delta']:g}, {res['accountant']}: noise std "
        "on a class mean in units of R/n (fixed denominator q*n)"
    )
    print("| epsilon | T | q | sigma_q | sigma_q / q | sigma (q=1) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['epsilon']:g} | {r['rounds']} | {r['sample_rate']:g} | {r['sigma']:.3f} | "
            f"{r['noise_on_mean']:.3f} | {r['full_sample_sigma']:.3f} | {r['ratio']:.3f} |"
        )


def _print_calibration(res: dict[str, Any]) -> None:
    head = (
        f"{res['mechanism']}: epsilon={res['epsilon']:g}, delta={res['delta']:g}, "
        f"rounds={res['rounds']}, accountant={res['accountant']}"
    )
    print(head)
    if "sigma_A" not in res:
        q = res.get("sample_rate", 1.0)
        delta = "2R/n" if res.get("neighbouring") == "replace_one" else "R/n"
        if q < 1:
            delta = f"R/({q:g} n): Poisson subsample, fixed denominator"
        print(f"  sigma = {res['sigma']:.4f}   (noise std per dim = sigma * {delta})")
        return
    lam = res["laplace_scale"]
    print(f"  split={res['split']}, variant={res['variant']}, k=d_A={res['k']} of {res['dim']}")
    print(f"  sigma_ref = {res['sigma']:.4f}   (IGPP at the same budget: {res['sigma_iso']:.4f})")
    print(f"  sigma_A = {res['sigma_A']:.4f}, sigma_B = {res['sigma_B']:.4f}")
    print(
        f"  selection: {res['selections']} x pure eps={res['eps_select']:.4g}, Laplace scale "
        + ("n/a" if lam is None else f"{lam:.4g}")
    )
    print(
        f"  per-dim noise std relative to IGPP: A {res['rel_std_A']:.3f}, B {res['rel_std_B']:.3f}"
    )


def _table(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for eps in args.epsilons:
        row: dict[str, Any] = {"epsilon": eps}
        for acc in ACCOUNTANTS:
            row[f"igpp_{acc}"] = calibrate_gaussian(eps, args.delta, args.rounds, acc)
            for split in SPLITS:
                b = calibrate_vpp(
                    eps,
                    args.delta,
                    args.rounds,
                    ratio=args.ratio,
                    rho=args.rho,
                    dim=args.dim,
                    split=split,
                    accountant=acc,
                )
                row[f"vpp_{split}_{acc}"] = b.sigma_ref
        rows.append(row)
    return {"delta": args.delta, "rounds": args.rounds, "rows": rows}


def _print_table(res: dict[str, Any]) -> None:
    cols = [k for k in res["rows"][0] if k != "epsilon"]
    print(f"sigma (noise multiplier), T={res['rounds']}, delta={res['delta']:g}")
    print("| epsilon | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row in res["rows"]:
        print(f"| {row['epsilon']:g} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")


def _overlap(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    c, d = args.classes, args.dim
    results = []
    datasets = []
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        k_sig = max(1, math.ceil(args.informative * d))
        signal_dims = torch.randperm(d, generator=g)[:k_sig]
        mu = torch.zeros(c, d)
        mu[:, signal_dims] = args.signal * torch.randn(c, k_sig, generator=g)
        n = args.per_class * c
        y = torch.arange(n) % c
        x = mu[y] + torch.randn(n, d, generator=g)
        y_test = torch.arange(1000) % c
        x_test = mu[y_test] + torch.randn(1000, d, generator=g)
        scale = 5.0 / float(x.norm(dim=1).median())  # median norm = R = 5
        datasets.append((x * scale, y, x_test * scale, y_test))

    def accuracy(
        protos: torch.Tensor, classes: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor
    ) -> float:
        p = torch.nn.functional.normalize(protos, dim=1)
        sim = torch.nn.functional.normalize(xt, dim=1) @ p.T
        return float((classes[sim.argmax(dim=1)] == yt).float().mean())

    setups: list[tuple[str, str]] = [("igpp", "-")] + [("vpp", v) for v in args.variants]
    for eps in args.epsilons:
        for mech, variant in setups:
            kwargs: dict[str, Any] = {"mechanism": mech, "epsilon": eps, "delta": args.delta}
            if mech == "vpp":
                kwargs["vpp_variant"] = variant
            cfg = PrivacyConfig(**kwargs)
            m = create_mechanism(cfg, rounds=args.rounds, dim=d)
            overlaps, accs = [], []
            for seed, (x, y, xt, yt) in enumerate(datasets):
                gen = torch.Generator().manual_seed(1000 + seed)
                for _ in range(args.rounds):
                    rel = m.release(x, y, num_classes=c, generator=gen, client=f"seed{seed}")
                    if "partition_overlap" in rel.info:
                        overlaps.append(rel.info["partition_overlap"])
                    accs.append(accuracy(rel.prototypes, rel.classes, xt, yt))
            results.append(
                {
                    "epsilon": eps,
                    "mechanism": mech,
                    "variant": variant,
                    "sigma": m.describe()["sigma"],
                    "overlap": sum(overlaps) / len(overlaps) if overlaps else None,
                    "proto_acc": sum(accs) / len(accs),
                }
            )
    clean = [accuracy(*_class_means(x, y, c), xt, yt) for x, y, xt, yt in datasets]
    return {
        "rounds": args.rounds,
        "delta": args.delta,
        "per_class": args.per_class,
        "rho_chance": math.ceil(PrivacyConfig().vpp_rho * d) / d,
        "nonprivate_proto_acc": sum(clean) / len(clean),
        "results": results,
    }


def _class_means(x: Any, y: Any, c: int) -> tuple[Any, Any]:
    import torch

    return torch.stack([x[y == i].mean(dim=0) for i in range(c)]), torch.arange(c)


def _print_overlap(res: dict[str, Any]) -> None:
    print(
        f"synthetic features, {res['per_class']} per class, T={res['rounds']}, "
        f"delta={res['delta']:g}; chance overlap = {res['rho_chance']:.3f}; "
        f"non-private prototype accuracy = {res['nonprivate_proto_acc']:.3f}"
    )
    print("| epsilon | mechanism | variant | sigma | partition overlap | prototype acc |")
    print("|---|---|---|---|---|---|")
    for r in res["results"]:
        ov = "-" if r["overlap"] is None else f"{r['overlap']:.3f}"
        print(
            f"| {r['epsilon']:g} | {r['mechanism']} | {r['variant']} | {r['sigma']:.2f} | {ov} | "
            f"{r['proto_acc']:.3f} |"
        )


def run_privacy(args: argparse.Namespace) -> int:
    """Handler for ``protofl privacy ...``; returns the exit status."""
    try:
        if args.privacy_command == "calibrate":
            res = _calibrate(args)
            printer = _print_calibration
        elif args.privacy_command == "table":
            res = _table(args)
            printer = _print_table
        elif args.privacy_command == "sampling":
            res = _sampling(args)
            printer = _print_sampling
        elif args.privacy_command == "overlap":
            res = _overlap(args)
            printer = _print_overlap
        else:  # pragma: no cover - argparse enforces the choice
            raise ValueError(f"unknown privacy command {args.privacy_command!r}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(res))
    else:
        printer(res)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m protofl.privacy.cli privacy calibrate ...``."""
    parser = argparse.ArgumentParser(prog="protofl")
    add_privacy_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
