"""The privacy plug-in: clipping, prototype mechanisms, DCR and accounting; usable standalone."""

from protofl.privacy import mechanisms as _mechanisms  # noqa: F401  (registers igpp and vpp)
from protofl.privacy.accounting import calibrate_gaussian, calibrate_vpp, epsilon_spent
from protofl.privacy.base import MECHANISM_REGISTRY, Mechanism, Release, create_mechanism
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.facade import PrototypePrivacy
from protofl.privacy.mechanisms import IGPP, VPP

__all__ = [
    "IGPP",
    "MECHANISM_REGISTRY",
    "VPP",
    "Mechanism",
    "PrivacyConfig",
    "PrototypePrivacy",
    "Release",
    "calibrate_gaussian",
    "calibrate_vpp",
    "create_mechanism",
    "epsilon_spent",
]
