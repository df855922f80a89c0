"""protofl.models."""

from protofl.models import heterogeneous as _heterogeneous  # noqa: F401  ("htfe4", "htc4", ...)
from protofl.models import resnet as _resnet  # noqa: F401  ("resnet10", "resnet18")
from protofl.models import transformers_backbones as _tfb  # noqa: F401  (ViT, text; lazy import)
