"""The facade's ledger with Google's dp-accounting: what the events are, and how to compose them
with a mechanism of your own.

A ``PrototypePrivacy`` charges each release as JSON-safe events:

* ``{"kind": "gaussian", "noise_multiplier": z}``: one Gaussian release whose noise std is z
  times its L2 sensitivity (all per-class prototypes of a round together: they compose in
  parallel, one example touches one class);
* ``{"kind": "pure", "epsilon": e}``: one pure e-DP step (VPP's private top-k selection).

    python examples/dp_accounting_ledger.py          # a few seconds
"""

from __future__ import annotations

import dp_accounting
import torch
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pldlib

from protofl.privacy import PrototypePrivacy

ROUNDS, DELTA = 20, 1e-5
g = torch.Generator().manual_seed(0)
x, y = torch.randn(200, 16, generator=g), torch.arange(200) % 4

# ----- 1. IGPP: Gaussian events map one-to-one onto dp-accounting's GaussianDpEvent ----------
igpp = PrototypePrivacy(mechanism="igpp", epsilon=1.0, delta=DELTA, rounds=ROUNDS, dim=16)
for _ in range(ROUNDS):
    igpp.release(x, y, num_classes=4)
events = igpp.events()
print("first events:", events[:2])
gaussians = [dp_accounting.GaussianDpEvent(e["noise_multiplier"]) for e in events]
accountant = dp_accounting.pld.PLDAccountant()
accountant.compose(dp_accounting.ComposedDpEvent(gaussians))
print(
    f"IGPP, {ROUNDS} releases: protofl {igpp.epsilon_spent():.4f}, "
    f"dp-accounting PLD {accountant.get_epsilon(DELTA):.4f}"
)

# ----- 2. Compose with your own mechanism: say each round you also release the client's sample
# count with Laplace noise of scale 10 (sensitivity 1 under add/remove): a LaplaceDpEvent. ------
mine = dp_accounting.SelfComposedDpEvent(dp_accounting.LaplaceDpEvent(10.0), ROUNDS)
both = dp_accounting.pld.PLDAccountant()
both.compose(dp_accounting.ComposedDpEvent([*gaussians, mine]))
print(f"IGPP + your Laplace counts: {both.get_epsilon(DELTA):.4f} (the budget grows; say so)")

# ----- 3. VPP: its pure events are *generic* eps0-DP steps (a private top-k is not a Laplace
# release of one number), so compose them as PLDs from their privacy parameters, as protofl does.
vpp = PrototypePrivacy(mechanism="vpp", epsilon=1.0, delta=DELTA, rounds=ROUNDS, dim=16)
for _ in range(ROUNDS):
    vpp.release(x, y, num_classes=4)
pld = None
for e in vpp.events():
    if e["kind"] == "gaussian":
        step = pldlib.from_gaussian_mechanism(
            e["noise_multiplier"], value_discretization_interval=1e-3
        )
    else:
        params = pld_common.DifferentialPrivacyParameters(e["epsilon"], 0.0)
        step = pldlib.from_privacy_parameters(params, value_discretization_interval=1e-3)
    pld = step if pld is None else pld.compose(step)
assert pld is not None
print(
    f"VPP, {ROUNDS} releases: protofl {vpp.epsilon_spent():.4f}, "
    f"dp-accounting PLD {pld.get_epsilon_for_delta(DELTA):.4f}"
)
