"""Data sets (one module per family), partitioners and the feature cache."""

from protofl.data import toy as _toy  # noqa: F401  (registers "toy")
from protofl.data.base import DATASET_REGISTRY, DomainData, DomainSplit, MultiDomainDataset

try:  # the embedded benchmark
    from protofl.data import digits4 as _digits4  # noqa: F401
except ImportError as _exc:  # pragma: no cover - only while the module is being written
    if "digits4" not in str(_exc):
        raise

__all__ = ["DATASET_REGISTRY", "DomainData", "DomainSplit", "MultiDomainDataset"]
