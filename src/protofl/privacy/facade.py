"""``PrototypePrivacy``: the VPDR plug-in in front of anyone's federated-learning code.

One object per client, in the spirit of Opacus' ``PrivacyEngine``: it calibrates the mechanism
once for the whole run, owns the client's noise key (secret by default), releases noisy
prototypes and charges its ledger, refuses a release past the budget, reports the epsilon
spent, offers the DCR hooks for the user's training step, and round-trips through
``state_dict``/``load_state_dict`` so the user's checkpoint carries it::

    privacy = PrototypePrivacy(epsilon=1.0, rounds=20, mechanism="vpdr")
    for rnd in range(20):
        dcr = privacy.dcr(head)                      # once (VPDR Sec. 4.3); None without DCR
        for x, y in loader:                          # the user's local step
            f_raw = adapter(backbone(x)); f = dcr.soft_clip(f_raw); logits = head(f)
            loss = ce(logits, y) + my_proto_loss(f, y) + dcr.kd_loss(f_raw, logits)
            loss.backward(); opt.step(); opt.zero_grad(); dcr.after_step(head)
        release = privacy.release(features, labels, num_classes=10)   # noisy, charged
        send(release.prototypes, release.classes, release.counts)
    privacy.epsilon_spent()

The numbers are protofl's own engine's: the same mechanism, the same draws in the same order
(the tests compare a release of the facade with the engine's for the same settings).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from protofl.privacy.base import ClusterFn, Mechanism, Release, create_mechanism
from protofl.privacy.client import PrivateClient
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.dcr import DCR
from protofl.privacy.guarantee import describe_guarantee
from protofl.privacy.ledger import PrivacyLedger
from protofl.privacy.noise import NOISE_KEY_NOTES, NoiseKey, noise_key, resolve_noise_mode


class PrototypePrivacy:
    """Calibrated prototype release, noise key, ledger and DCR of ONE client: a thin
    constructor over :class:`~protofl.privacy.client.PrivateClient` (what protofl's engines
    hold for each client), adding the plug-in's input checks and its own release budget.

    Build it from keyword settings (any :class:`PrivacyConfig` field: ``epsilon``, ``delta``,
    ``mechanism`` (``igpp`` | ``vpp`` | ``vpdr``, the default), ``clip``, ``vpp_*``, ``dcr_*``
    ...) or from ``config=PrivacyConfig(...)``; ``rounds`` is how many releases the budget must
    cover and ``dim`` the prototype dimension.

    Noise key: ``noise_seed="secret"`` (default; ``auto`` means secret here, the facade does not
    know who else holds your config) draws the key from the operating system and never exposes
    it; ``"derived"`` needs ``seed`` and ``client`` and reproduces protofl's engine exactly, but
    anyone who knows (seed, client) can remove the noise.
    """

    def __init__(
        self,
        *,
        rounds: int,
        dim: int = 512,
        config: PrivacyConfig | None = None,
        seed: int | None = None,
        client: int = 0,
        name: str = "client",
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise ValueError(
                "pass either config=PrivacyConfig(...) or keyword settings, not both: "
                + ", ".join(sorted(settings))
            )
        if config is None:
            fields = {f.name for f in dataclasses.fields(PrivacyConfig)}
            unknown = sorted(set(settings) - fields)
            if unknown:
                raise ValueError(
                    f"unknown privacy setting(s) {unknown}; valid: {', '.join(sorted(fields))}"
                )
            settings.setdefault("noise_seed", "secret")
            settings.setdefault("mechanism", "vpdr")  # the plug-in: VPP + DCR
            config = PrivacyConfig(**settings)
        if config.base_mechanism == "none":
            raise ValueError("PrototypePrivacy needs a private mechanism: igpp, vpp or vpdr")
        if config.mechanism == "ddg":
            raise ValueError(
                "PrototypePrivacy releases one client's prototypes; privacy.mechanism=ddg is a "
                "share of a secure sum over a federation (run it with protofl run, "
                "run.engine=sim); use igpp, vpp or vpdr here"
            )
        self.config = config
        self.rounds = rounds
        self.name = name
        self.client = client
        # the facade cannot know whether a server holds the config: auto means secret
        self.noise_key = resolve_noise_mode(
            "secret" if config.noise_seed == "auto" else config.noise_seed, deployment=False
        )
        if self.noise_key == "derived" and seed is None:
            raise ValueError("noise_seed='derived' needs seed= (and client=) to derive the key")
        # the engines' own per-client privacy state: calibrated mechanism, a 256-bit noise
        # key ratcheted after every draw (a secret one never leaves it), ledger, DCR
        self.private = PrivateClient(
            config,
            mechanism=create_mechanism(config, rounds=rounds, dim=dim),
            key=noise_key(self.noise_key, 0 if seed is None else seed, client),
            name=name,
        )
        self.releases_made = 0

    @property
    def mechanism(self) -> Mechanism:
        """The calibrated mechanism."""
        return self.private.mechanism

    @property
    def generator(self) -> NoiseKey:
        """The noise key (a secret key's bytes are never in any state this object returns)."""
        return self.private.key

    @property
    def ledger(self) -> PrivacyLedger:
        """The ledger every release is charged to."""
        return self.private.ledger

    # ----- releasing ----------------------------------------------------------------------------
    @property
    def sigma(self) -> float:
        """The noise multiplier of one release (what the ledger charges)."""
        return float(getattr(self.mechanism, "sigma", float("nan")))

    def releases_left(self) -> int:
        """How many more releases the calibrated budget covers."""
        return self.rounds - self.releases_made

    def release(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_classes: int,
        cluster_fn: ClusterFn | None = None,
    ) -> Release:
        """Clip, average per class, add the calibrated noise; charge the ledger.

        Refuses (RuntimeError) once ``rounds`` releases were made.  Send only the release's
        ``prototypes``, ``classes``, ``counts`` (and, if your server validates them,
        ``sensitivity``/``noise_std``/``events``); never its ``diagnostics``.
        """
        features, labels = self._inputs(features, labels)
        if self.releases_made >= self.rounds:
            raise RuntimeError(
                f"{self.name}: all {self.rounds} releases of the budget are spent "
                f"(epsilon {self.epsilon_spent():.4g}); another one would exceed it"
            )
        # the release slot is taken before any noise is drawn: a release that fails after its
        # first draw still counts (conservative; one refused before any draw, e.g. for bad
        # input, does not), and nothing is returned before the ledger holds it
        index, draws = self.releases_made, self.generator.draws
        self.releases_made += 1
        try:
            return self.private.release(
                features, labels, num_classes=num_classes, round_index=index, cluster_fn=cluster_fn
            )
        except Exception:
            if self.generator.draws == draws:
                self.releases_made = index
            raise

    def _inputs(self, features: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``features`` as a floating tensor of at least float32 precision (clipping and noise
        in float16 would round the clip bound and the noise), ``labels`` as int64 on the same
        device; numpy arrays are converted; anything else is refused naming the argument."""
        if isinstance(features, np.ndarray):
            features = torch.from_numpy(np.ascontiguousarray(features))
        if isinstance(labels, np.ndarray):
            labels = torch.from_numpy(np.ascontiguousarray(labels))
        if not isinstance(features, torch.Tensor):
            raise TypeError(
                f"{self.name}: features must be a torch.Tensor or numpy array, got "
                f"{type(features).__name__}"
            )
        if not isinstance(labels, torch.Tensor):
            raise TypeError(
                f"{self.name}: labels must be a torch.Tensor or numpy array, got "
                f"{type(labels).__name__}"
            )
        if not features.is_floating_point():
            raise TypeError(
                f"{self.name}: features must be floating point, got {features.dtype} "
                "(pass the feature vectors, not indices or quantised values)"
            )
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise TypeError(f"{self.name}: labels must be integer class ids, got {labels.dtype}")
        if labels.device != features.device:
            raise ValueError(
                f"{self.name}: labels are on {labels.device} but features on "
                f"{features.device}; move both to one device"
            )
        if features.dtype in (torch.float16, torch.bfloat16):
            features = features.float()
        return features.detach(), labels.to(torch.long)

    def epsilon_spent(self) -> float:
        """Epsilon at the configured delta of every release made so far (0 before the first)."""
        eps = self.ledger.epsilon_spent()
        return 0.0 if eps is None else float(eps)

    def events(self) -> list[dict[str, Any]]:
        """The DP events charged so far (``gaussian`` noise multipliers, ``pure`` epsilons), to
        compose with your own mechanisms (see examples/dp_accounting_ledger.py)."""
        return self.ledger.events()

    def guarantee(
        self, *, shares_weights: bool = False, trained_feature_map: bool = False
    ) -> dict[str, Any]:
        """What the guarantee covers (:func:`~protofl.privacy.guarantee.describe_guarantee`).

        The sensitivity 2R/n assumes the features you release come from a map that does not
        depend on this client's data (a frozen or public encoder); if you train the feature
        extractor on the same data between releases, pass ``trained_feature_map=True``: the
        statement then says that part is not covered."""
        return describe_guarantee(
            self.config,
            noise_key=self.noise_key,
            rounds=self.rounds,
            shares_weights=shares_weights,
            trained_feature_map=trained_feature_map,
        )

    # ----- DCR ------------------------------------------------------------------------------------
    def dcr(self, head: nn.Module) -> DCR | None:
        """The DCR hooks for ``head`` (created once; None unless the mechanism is ``vpdr`` or
        ``dcr=True``): ``soft_clip(f_raw)`` before the head, ``kd_loss(f_raw, logits)`` to add
        to the loss, ``after_step(head)`` after each optimiser step.  No privacy cost."""
        return self.private.attach_dcr(head)

    # ----- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything to continue: ledger, release count, mechanism state, DCR teacher, and the
        noise key's state: a derived key's (reproducible from seed and client anyway), for a
        secret key only its draw count, never the key (a restored facade draws fresh noise).
        The returned dict is a copy: later releases do not change it."""
        return copy.deepcopy(
            {
                "config": dataclasses.asdict(self.config),
                "rounds": self.rounds,
                "noise_key": self.noise_key,
                "releases_made": self.releases_made,
                "ledger": self.ledger.state_dict(),
                "mechanism": self.mechanism.state_dict(),
                "generator": self.generator.state_dict(),
                "dcr": None if self.private.dcr is None else self.private.dcr.state_dict(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; refuses a state made with other settings, and one
        with fewer releases than this object has made (a rollback would undercount the budget
        and, with a derived key, replay noise)."""
        mine = dataclasses.asdict(self.config)
        diff = sorted(k for k in mine if state["config"].get(k) != mine[k])
        if diff or state["rounds"] != self.rounds or state["noise_key"] != self.noise_key:
            raise ValueError(
                "this PrototypePrivacy state was made with other settings: "
                + ", ".join(f"{k}: {state['config'].get(k)!r} != {mine[k]!r}" for k in diff)
                + (
                    f"; rounds {state['rounds']} != {self.rounds}"
                    if state["rounds"] != self.rounds
                    else ""
                )
                + (
                    f"; noise key {state['noise_key']!r} != {self.noise_key!r}"
                    if state["noise_key"] != self.noise_key
                    else ""
                )
            )
        saved = int(state["releases_made"])
        if saved < self.releases_made:
            raise ValueError(
                f"{self.name}: the state holds {saved} releases but {self.releases_made} were "
                "already made here; loading it would roll the ledger back (refused)"
            )
        generator = state.get("generator")
        if not isinstance(generator, dict):
            raise ValueError(
                f"{self.name}: the state's noise generator is from an older protofl (a 32-bit "
                "torch generator, which may hold the secret key); it cannot be loaded"
            )
        if state.get("dcr") is not None and self.private.dcr is None:
            raise ValueError("the state holds a DCR teacher: call dcr(head) before loading")
        state = copy.deepcopy(state)
        self.generator.load_state_dict(generator)
        self.releases_made = saved
        self.ledger.load_state_dict(state["ledger"])
        self.mechanism.load_state_dict(state["mechanism"])
        if state.get("dcr") is not None and self.private.dcr is not None:
            self.private.dcr.load_state_dict(state["dcr"])

    def describe(self) -> dict[str, Any]:
        """Calibration facts (sigma, accountant, budget, relation) and the noise-key mode."""
        return {
            **self.mechanism.describe(),
            "noise_key": self.noise_key,
            "noise_key_note": NOISE_KEY_NOTES[self.noise_key],
        }
