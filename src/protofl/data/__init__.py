"""Data sets (one module per family), partitioners and the feature cache."""

from protofl.data import cifar as _cifar  # noqa: F401  ("cifar10", "cifar100")
from protofl.data import digits4 as _digits4  # noqa: F401  (registers "digits4")
from protofl.data import digits_files as _digits_files  # noqa: F401  (registers "digits")
from protofl.data import domainnet as _domainnet  # noqa: F401  (registers "domainnet")
from protofl.data import hfdatasets as _hfdatasets  # noqa: F401  (registers "hf")
from protofl.data import office as _office  # noqa: F401  ("office_caltech10", "office_home")
from protofl.data import pacs as _pacs  # noqa: F401  (registers "pacs")
from protofl.data import text as _text  # noqa: F401  (rotten_tomatoes, ag_news, text_files)
from protofl.data import toy as _toy  # noqa: F401  (registers "toy")
from protofl.data import user_images as _user_images  # noqa: F401  (registers "imagefolder")
from protofl.data import vlcs as _vlcs  # noqa: F401  (registers "vlcs")
from protofl.data.base import DATASET_REGISTRY, DomainData, DomainSplit, MultiDomainDataset

__all__ = ["DATASET_REGISTRY", "DomainData", "DomainSplit", "MultiDomainDataset"]
