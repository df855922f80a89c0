"""What a run's privacy guarantee covers, stated per client, for summary.json, console and report.

A printed (epsilon, delta) is only as good as what travels around the mechanism.  The
statement names the neighbouring relation, the noise-key mode and every part of what leaves a
client that the guarantee does not cover, so it is never read as stronger than what is proven.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from protofl.privacy.config import PrivacyConfig
from protofl.privacy.noise import NOISE_KEY_NOTES

CLUSTER_GAP = (
    "cluster membership: the clusters are chosen from the private features (local FINCH) and "
    "their sizes are released exactly; replacing one example can change other examples' "
    "clusters and the sizes, so the stated epsilon holds only for a fixed assignment "
    "(fedplvm local_clustering=false releases class means and is covered)"
)
WEIGHTS_GAP = "model weights: the method uploads trained weights without noise"
DERIVED_GAP = (
    "the noise itself: the noise key is derived from the config, so whoever holds the config "
    "(the server) can regenerate and remove it"
)
EVALUATION_SCOPE = (
    "the test split: per-client accuracy and test-set size are reported for evaluation; the "
    "guarantee protects the training data"
)
EVALUATION_GAP = (
    "per-client evaluation: each reported accuracy is measured with a model trained on the "
    "client's private data and sent without noise; whoever replays training from the config "
    "can tell neighbouring data sets apart from it"
)
TRAINED_MAP_GAP = (
    "the trained feature map: from the second release on, prototypes are means of features "
    "from an adapter/projection trained on the client's own data without DP; replacing one "
    "example changes that map and so every feature, so the per-example sensitivity 2R/n (R/n) "
    "does not bound the change and the stated epsilon is proven only for releases of a map "
    "that does not depend on the data (the first release, from the public initialisation)"
)
DIAGNOSTICS_GAP = (
    "diagnostics: values computed on the private data outside any mechanism (VPP's partition "
    "overlap, the training loss) reached the server (run.diagnostics=true)"
)


def ddg_assumptions(config: PrivacyConfig) -> list[str]:
    """What ``privacy.mechanism: ddg``'s guarantee assumes beyond the mechanism itself."""
    return [
        "an honest-but-curious server: it follows the secure-aggregation protocol and sees "
        "only the sum of each round's client vectors, never one client's (against a server "
        "that sees a single vector, only that client's own 1/sqrt(n) share of the noise "
        "protects it)",
        f"at most {config.ddg_max_dropped} dropped or colluding clients a round "
        "(privacy.ddg_max_dropped): the noise is calibrated to the shares of the others",
        "an in-process secure sum: the simulator computes the sum with the protocol's "
        "arithmetic (quantisation, modular wrap) but no cryptography",
    ]


def describe_guarantee(
    config: PrivacyConfig,
    *,
    noise_key: str,
    rounds: int,
    clustered: bool = False,
    shares_weights: bool = False,
    uses_prototypes: bool = True,
    other_uploads: Sequence[str] = (),
    evaluation_reported: bool = False,
    diagnostics_reported: bool = False,
    trained_feature_map: bool = False,
) -> dict[str, Any]:
    """The per-client guarantee of a run, with what it does not cover.

    ``noise_key``: the resolved mode (``derived``/``secret``); ``clustered``: releases are per
    data-dependent cluster; ``shares_weights``: the method uploads model weights;
    ``other_uploads``: what else the method sends outside the mechanism (``"name: what"``
    each, a method's ``extra_uploads``), computed from the private data and not covered;
    ``evaluation_reported``: per-client accuracies of the trained models reach the server (or
    whoever reads the run's metrics); ``diagnostics_reported``: local-only diagnostics did;
    ``trained_feature_map``: releases after the first are computed through a feature map the
    client trained on the same private data (the sensitivity then does not hold).
    """
    gaps: list[str] = []
    if shares_weights:
        gaps.append(WEIGHTS_GAP)
    gaps += [f"{item} (sent without noise)" for item in other_uploads]
    if config.base_mechanism == "none" or not uses_prototypes:
        return {
            "epsilon": None,
            "delta": None,
            "noise_key": noise_key,
            "complete": False,
            "holds_against_server": False,
            "not_covered": gaps or ["everything: no privacy mechanism"],
            "outside_scope": [EVALUATION_SCOPE],
            "statement": "no privacy guarantee (mechanism none)"
            if uses_prototypes
            else "no privacy guarantee (the method releases no prototypes)",
        }
    if clustered:
        gaps.append(CLUSTER_GAP)
    if trained_feature_map and rounds > 1:
        gaps.append(TRAINED_MAP_GAP)
    if noise_key == "derived":
        gaps.append(DERIVED_GAP)
    if evaluation_reported:
        gaps.append(EVALUATION_GAP)
    if diagnostics_reported:
        gaps.append(DIAGNOSTICS_GAP)
    complete = not gaps
    counts = {
        "replace_one": "class counts released exactly (public under replace-one)",
        "add_remove": "class counts public by assumption"
        if config.addremove_counts == "public"
        else "class counts released with noise and charged",
    }[config.neighbouring]
    releases = (
        "one release, re-sent unchanged: release_schedule once"
        if config.release_schedule == "once"
        else f"{rounds} releases"
    )
    kind = "distributed DP (secure sums)" if config.mechanism == "ddg" else "local DP"
    statement = (
        f"({config.epsilon:g}, {config.delta:g})-{kind} per client over the whole run "
        f"({releases}), {config.neighbouring}, noise key {noise_key}"
    )
    assumes = ddg_assumptions(config) if config.mechanism == "ddg" else []
    if assumes:
        statement += "; assumes " + " and ".join(a.split(":")[0] for a in assumes)
    if config.sampled:
        statement += (
            f", each release a Poisson subsample at rate {config.sample_rate:g} (amplification "
            "by subsampling: the sample stays secret only if the noise key does)"
        )
    statement += (
        "; complete" if complete else "; NOT covered: " + "; ".join(g.split(":")[0] for g in gaps)
    )
    return {
        "epsilon": config.epsilon,
        "delta": config.delta,
        "rounds": rounds,
        "neighbouring": config.neighbouring,
        "counts": counts,
        **({"sample_rate": config.sample_rate} if config.sampled else {}),
        "noise_key": noise_key,
        "noise_key_note": NOISE_KEY_NOTES[noise_key],
        "covers": "every prototype release of the client's training data over the run",
        **({"assumes": assumes} if assumes else {}),
        "not_covered": gaps,
        "outside_scope": [EVALUATION_SCOPE],
        "complete": complete,
        "holds_against_server": complete,
        "statement": statement,
    }
