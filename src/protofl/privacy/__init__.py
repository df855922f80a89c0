"""The privacy plug-in: clipping, prototype mechanisms, DCR and accounting; usable standalone.

Importing it registers the mechanisms (one per file: igpp, vpp, ddg; the common pipeline of
igpp and vpp in prototype).
"""

from protofl.privacy.accounting import calibrate_gaussian, calibrate_vpp, epsilon_spent
from protofl.privacy.base import MECHANISM_REGISTRY, Mechanism, Release, create_mechanism
from protofl.privacy.config import PrivacyConfig
from protofl.privacy.ddg import DistributedDiscreteGaussian
from protofl.privacy.facade import PrototypePrivacy
from protofl.privacy.igpp import IGPP
from protofl.privacy.vpp import VPP

__all__ = [
    "IGPP",
    "MECHANISM_REGISTRY",
    "VPP",
    "DistributedDiscreteGaussian",
    "Mechanism",
    "PrivacyConfig",
    "PrototypePrivacy",
    "Release",
    "calibrate_gaussian",
    "calibrate_vpp",
    "create_mechanism",
    "epsilon_spent",
]
