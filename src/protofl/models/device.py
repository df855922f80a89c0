"""Where protofl computes: ``run.device`` (``auto | cpu | cuda | cuda:N``) and what goes with it.

``auto`` is a GPU when torch sees one, else the CPU.  On a CUDA device, torch's deterministic
algorithms are switched on (``warn_only``: an operation without a deterministic CUDA kernel warns
once instead of failing) and ``CUBLAS_WORKSPACE_CONFIG`` is set, so the same config and seed give
the same numbers on the same device and software (docs/performance.md, "GPU").  Randomness never
moves: every generator protofl uses is a CPU ``torch.Generator``; what is drawn is moved to the
device afterwards, so a noise key or a batch order means the same on every device.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from protofl.errors import ConfigError

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
AMP_CHOICES = ("none", "bf16")
CUBLAS_WORKSPACE = ":4096:8"

T = TypeVar("T")


def check_device_setting(setting: str) -> None:
    """The form of ``run.device`` (no hardware asked): ``auto``, ``cpu``, ``cuda``, ``cuda:N``."""
    if not isinstance(setting, str) or not DEVICE_PATTERN.match(setting):
        raise ConfigError(
            f"run.device={setting!r}: write auto, cpu, cuda or cuda:N (N a GPU index)"
        )


def resolve_device(setting: str = "auto") -> torch.device:
    """The device ``run.device`` names on this machine; a GPU that is not there fails in one
    line naming the setting (:class:`~protofl.errors.ConfigError`)."""
    check_device_setting(setting)
    if setting == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if setting == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device()) if available else torch.device("cpu")
        )
    if not available:
        raise ConfigError(
            f"run.device={setting}: torch sees no CUDA GPU on this machine (torch "
            f"{torch.__version__}); use run.device=cpu or auto"
        )
    index = int(setting.split(":")[1]) if ":" in setting else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"run.device={setting}: torch sees {count} CUDA GPU(s) (cuda:0 .. cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def prepare_device(setting: str = "auto") -> torch.device:
    """:func:`resolve_device`, and on CUDA the deterministic settings (process-wide, set once:
    ``CUBLAS_WORKSPACE_CONFIG`` unless the user set it, deterministic algorithms with
    ``warn_only``, no TF32 matrix products)."""
    device = resolve_device(setting)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def describe_device(device: torch.device) -> dict[str, Any]:
    """What a run records about its device (summary.json, the log): name, type, memory."""
    out: dict[str, Any] = {"device": str(device), "type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(
            {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda,
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            }
        )
    else:
        out["name"] = "cpu"
    return out


def check_amp_setting(setting: str) -> None:
    """The form of ``run.amp``: ``none`` or ``bf16``."""
    if setting not in AMP_CHOICES:
        raise ConfigError(f"run.amp={setting!r}: choose one of {', '.join(AMP_CHOICES)}")


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``amp`` is ``bf16``; else a no-op context."""
    if amp == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(value: T, device: torch.device) -> T:
    """``value`` with every tensor inside (dicts, lists, tuples) on ``device``; tensors already
    there are returned as they are (no copy on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)  # type: ignore[return-value]
    if isinstance(value, Mapping):
        return type(value)((k, to_device(v, device)) for k, v in value.items())  # type: ignore[call-arg]
    if isinstance(value, list):
        return [to_device(v, device) for v in value]  # type: ignore[return-value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_device(v, device) for v in value)  # type: ignore[return-value]
    return value


def to_cpu(value: T) -> T:
    """``value`` with every tensor on the CPU (what checkpoints and artifacts store)."""
    return to_device(value, torch.device("cpu"))


def move_attributes(obj: Any, device: torch.device) -> None:
    """Move every module and tensor an object holds (its attributes, nested helper objects and
    lists of them) to ``device``, in place: what a frozen backbone needs to encode there."""
    seen: set[int] = set()

    def visit(item: Any) -> Any:
        if isinstance(item, torch.nn.Module):
            return item.to(device)
        if isinstance(item, torch.Tensor):
            return item.to(device)
        if id(item) in seen:
            return item
        seen.add(id(item))
        if isinstance(item, list):
            item[:] = [visit(v) for v in item]
        elif isinstance(item, dict):
            for k in list(item):
                item[k] = visit(item[k])
        elif hasattr(item, "__dict__") and type(item).__module__.startswith("protofl."):
            for k, v in list(vars(item).items()):
                setattr(item, k, visit(v))
        return item

    visit(obj)


@contextlib.contextmanager
def cuda_memory_scope(device: torch.device) -> Iterator[None]:
    """Free the CUDA cache after a block that may have run out of memory (no-op on the CPU)."""
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (None on the CPU)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def to_cpu_once(value: Any, memo: dict[tuple[Any, ...], torch.Tensor] | None = None) -> Any:
    """:func:`~protofl.models.device.to_cpu`, with one CPU copy of each distinct view (same
    storage, offset, shape, strides and dtype) however many entries hold it: a model's
    ``state_dict`` detaches each parameter anew, so identity cannot tell them apart."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value
        key = (
            str(value.device),
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
            value.dtype,
        )
        out = memo.get(key)
        if out is None:
            out = memo[key] = to_cpu(value)
        return out
    if isinstance(value, dict):
        return type(value)((k, to_cpu_once(v, memo)) for k, v in value.items())
    if isinstance(value, list):
        return [to_cpu_once(v, memo) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_cpu_once(v, memo) for v in value)
    return to_cpu(value)
