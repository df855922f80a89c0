"""Codec between protofl's uploads and global state and Flower records.

An :class:`~protofl.methods.base.Upload` travels as a :class:`flwr.app.RecordDict`:

* ``"release"`` (``ArrayRecord``, only when the client released prototypes): ``prototypes``
  [K, d] float, ``classes`` [K] int64, ``counts`` [K] int64, ``sensitivity`` [K] float,
  ``noise_std`` [K, d] float;
* ``"upload"`` (``ConfigRecord``): ``partition-id``, ``domain``, ``num-samples``,
  ``has-release``, ``mechanism`` and ``events`` (the release's DP events, JSON: exactly what the
  client's ledger was charged);
* ``"release-info"`` (``MetricRecord``): the release's ``info`` floats (sigma, diagnostics);
* ``"weights"`` (``ArrayRecord``, optional): model weights for methods that share them.

A :data:`~protofl.methods.base.GlobalState` (named tensors) is one ``ArrayRecord``.

Decoding never trusts its input: anything missing, of the wrong type or unreadable raises
:class:`CodecError` with a one-line reason that the strategy logs when it rejects the reply.
Shapes and values are checked afterwards by :func:`protofl.methods.validation.validate_upload`.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from protofl.methods.base import GlobalState, Upload
from protofl.privacy.base import Release

RELEASE_KEYS = ("prototypes", "classes", "counts", "sensitivity", "noise_std")
"""The tensors of one release, in the ``"release"`` ArrayRecord."""

RELEASED = "released by the privacy mechanism (noisy, charged)"
PUBLIC = "public: calibration facts or registration declared public"
COUNTS = "sample count: public under replace_one and add_remove with public counts"
EVALUATION = "evaluation on the test split (outside the training-data guarantee)"
DIAGNOSTIC = "diagnostic on private data: simulation only, never sent by a deployed client"
WEIGHTS = "model weights of a weight-sharing method (not covered by the guarantee)"

WIRE_FIELDS: dict[str, dict[str, dict[str, str]]] = {
    "hello": {
        "hello": {
            "partition-id": PUBLIC,
            "name": PUBLIC,
            "domain": PUBLIC,
            "domain-name": PUBLIC,
            "num-samples": COUNTS,
            "num-test": EVALUATION,
            "num-clients": PUBLIC,
            "num-classes": PUBLIC,
            "num-domains": PUBLIC,
            "has-holdout": PUBLIC,
            "method": PUBLIC,
            "mechanism": PUBLIC,
            "noise-key": PUBLIC,
        }
    },
    "release": {
        "upload": {
            "partition-id": PUBLIC,
            "domain": PUBLIC,
            "num-samples": COUNTS,
            "has-release": PUBLIC,
            "mechanism": PUBLIC,
            "events": RELEASED,
        },
        "release": dict.fromkeys(RELEASE_KEYS, RELEASED),
        "release-info": {"sigma": PUBLIC, "k": PUBLIC, "selected": RELEASED},
        "metrics": {"num-examples": COUNTS, "client-epsilon": RELEASED},
        "diagnostics": {"partition_overlap": DIAGNOSTIC},
    },
    "train": {
        "upload": {
            "partition-id": PUBLIC,
            "domain": PUBLIC,
            "num-samples": COUNTS,
            "has-release": PUBLIC,
        },
        "weights": {"*": WEIGHTS},
        "metrics": {"num-examples": COUNTS},
        "diagnostics": {"train-loss": DIAGNOSTIC},
    },
    "evaluate": {
        "metrics": {
            "partition-id": PUBLIC,
            "accuracy": EVALUATION,
            "num-examples": EVALUATION,
            "holdout-accuracy": EVALUATION,
        }
    },
}
"""Every field a client may send, per reply: record -> key -> why it may leave the client.
:func:`check_wire` enforces it on both ends (``"*"``: any key, for model weights)."""

DIAGNOSTIC_RECORD = "diagnostics"


class CodecError(ValueError):
    """A record could not be decoded; the message is the reason the reply is rejected."""


def wire_fields(content: Any) -> set[str]:
    """Every ``record.key`` a reply carries (``weights.*`` for model weights), for the record of
    what the server received."""
    out: set[str] = set()
    if not isinstance(content, RecordDict):
        return out
    for name, record in content.items():
        if name == "weights":
            out.add("weights.*")
            continue
        out.update(f"{name}.{key}" for key in record)
    return out


def check_wire(phase: str, content: Any, *, diagnostics: bool = False) -> None:
    """Raise CodecError naming the first record or field of ``content`` outside the allow-list
    of ``phase`` (:data:`WIRE_FIELDS`).  ``diagnostics``: the local-only diagnostics record is
    allowed (simulation); a deployed client never sends it and its server refuses it."""
    allowed = WIRE_FIELDS[phase]
    if not isinstance(content, RecordDict):
        raise CodecError(f"{phase} reply content is {type(content).__name__}, not a RecordDict")
    for name, record in content.items():
        if name not in allowed or (name == DIAGNOSTIC_RECORD and not diagnostics):
            raise CodecError(
                f"{phase} reply carries record {name!r}, which is not allowed on the wire"
            )
        fields = allowed[name]
        if "*" in fields:
            continue
        for key in record:
            if key not in fields:
                raise CodecError(
                    f"{phase} reply field {name}[{key!r}] is not allowed on the wire "
                    f"(allowed: {', '.join(fields)})"
                )


# ----- tensors --------------------------------------------------------------------------------
def tensor_to_array(tensor: torch.Tensor) -> Array:
    """A torch tensor as a Flower ``Array`` (numpy serialisation, no pickle)."""
    return Array(tensor.detach().cpu().contiguous().numpy())


def array_to_tensor(array: Any, what: str) -> torch.Tensor:
    """A Flower ``Array`` back to a torch tensor; CodecError if it is not a numeric array."""
    if not isinstance(array, Array):
        raise CodecError(f"{what} is not an Array but {type(array).__name__}")
    try:
        values = array.numpy()
    except Exception as exc:  # malformed bytes, unknown serialisation type
        raise CodecError(f"{what} cannot be read ({type(exc).__name__}: {exc})") from None
    if values.dtype.kind not in "biuf":
        raise CodecError(f"{what} has dtype {values.dtype}, expected a numeric type")
    return torch.from_numpy(np.array(values, copy=True))


def tensors_to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as one ArrayRecord (keys kept as they are)."""
    record = ArrayRecord()
    for key, value in tensors.items():
        record[key] = tensor_to_array(value)
    return record


def record_to_tensors(record: Any, what: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tensors_to_record`."""
    if not isinstance(record, ArrayRecord):
        raise CodecError(f"{what} is not an ArrayRecord but {type(record).__name__}")
    return {key: array_to_tensor(value, f"{what}[{key!r}]") for key, value in record.items()}


def encode_global_state(state: GlobalState) -> ArrayRecord:
    """What the server broadcasts, as one ArrayRecord."""
    return tensors_to_record(state)


def decode_global_state(record: Any) -> GlobalState:
    """Inverse of :func:`encode_global_state`."""
    return record_to_tensors(record, "global state")


# ----- uploads --------------------------------------------------------------------------------
def encode_upload(upload: Upload, *, partition_id: int | None = None) -> RecordDict:
    """One client's upload as a RecordDict (see the module docstring for its layout)."""
    meta: dict[str, Any] = {
        "partition-id": int(upload.client if partition_id is None else partition_id),
        "domain": int(upload.domain),
        "num-samples": int(upload.num_samples),
        "has-release": upload.release is not None,
    }
    content = RecordDict()
    r = upload.release
    if r is not None:
        content["release"] = tensors_to_record({key: getattr(r, key) for key in RELEASE_KEYS})
        meta["mechanism"] = str(r.mechanism)
        meta["events"] = json.dumps(r.events)
        content["release-info"] = MetricRecord({k: float(v) for k, v in r.info.items()})
    content["upload"] = ConfigRecord(meta)
    if upload.weights is not None:
        content["weights"] = tensors_to_record(upload.weights)
    return content


def _get(record: Any, key: str, types: tuple[type, ...], what: str) -> Any:
    if key not in record:
        raise CodecError(f"{what} has no {key!r}")
    value = record[key]
    if isinstance(value, bool) and bool not in types:
        raise CodecError(f"{what}[{key!r}] is a bool, expected {types[0].__name__}")
    if not isinstance(value, types):
        raise CodecError(f"{what}[{key!r}] is {type(value).__name__}, expected {types[0].__name__}")
    return value


def decode_events(text: Any) -> list[dict[str, Any]]:
    """The JSON list of DP events of a release; CodecError if it is not one."""
    if not isinstance(text, str):
        raise CodecError(f"events is {type(text).__name__}, expected a JSON string")
    try:
        events = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CodecError(f"events is not valid JSON ({exc})") from None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise CodecError("events must be a JSON list of objects")
    return events


def decode_upload(content: Any, *, client: int | None = None) -> Upload:
    """A RecordDict back to an Upload; ``client`` (the server's own mapping of the sending node)
    overrides the partition id the reply claims.  Raises CodecError with the reason."""
    if not isinstance(content, RecordDict):
        raise CodecError(f"reply content is {type(content).__name__}, not a RecordDict")
    if "upload" not in content:
        raise CodecError("reply has no 'upload' record")
    meta = content["upload"]
    if not isinstance(meta, ConfigRecord):
        raise CodecError(f"'upload' is a {type(meta).__name__}, expected a ConfigRecord")
    pid = int(_get(meta, "partition-id", (int,), "upload"))
    domain = int(_get(meta, "domain", (int,), "upload"))
    num_samples = _get(meta, "num-samples", (int,), "upload")
    has_release = bool(_get(meta, "has-release", (bool,), "upload"))
    release = None
    if has_release:
        if "release" not in content:
            raise CodecError("upload declares a release but the reply has no 'release' record")
        tensors = record_to_tensors(content["release"], "release")
        missing = [k for k in RELEASE_KEYS if k not in tensors]
        extra = sorted(set(tensors) - set(RELEASE_KEYS))
        if missing or extra:
            raise CodecError(f"release record has keys {sorted(tensors)}; expected {RELEASE_KEYS}")
        info_record = content.get("release-info", MetricRecord())
        if not isinstance(info_record, MetricRecord):
            raise CodecError("'release-info' is not a MetricRecord")
        info: dict[str, float] = {}
        for key, value in info_record.items():
            if not isinstance(value, int | float):
                raise CodecError(f"release-info[{key!r}] is not a number")
            info[key] = float(value)
        try:
            release = Release(
                prototypes=tensors["prototypes"],
                classes=tensors["classes"],
                counts=tensors["counts"],
                sensitivity=tensors["sensitivity"],
                noise_std=tensors["noise_std"],
                mechanism=str(_get(meta, "mechanism", (str,), "upload")),
                events=decode_events(_get(meta, "events", (str,), "upload")),
                info=info,
            )
        except ValueError as exc:  # Release.__post_init__ shape checks
            if isinstance(exc, CodecError):
                raise
            raise CodecError(f"inconsistent release: {exc}") from None
    elif "release" in content:
        raise CodecError("reply carries a 'release' record but declares has-release=false")
    weights = None
    if "weights" in content:
        weights = record_to_tensors(content["weights"], "weights")
    return Upload(
        client=pid if client is None else client,
        domain=domain,
        release=release,
        num_samples=num_samples,
        weights=weights,
    )


def claimed_partition(content: Any) -> int | None:
    """The partition id a reply claims (None when it does not say or cannot be read)."""
    try:
        meta = content["upload"]
        value = meta["partition-id"]
    except Exception:
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def claimed_release_facts(content: Any) -> tuple[str, list[dict[str, Any]]] | None:
    """(mechanism, DP events) a reply declares for its release, read from the ``upload``
    ConfigRecord alone, so a release whose tensors are malformed can still be charged.
    None when the reply declares no release or the facts cannot be read."""
    try:
        meta = content["upload"]
        if meta["has-release"] is not True:
            return None
        return str(meta["mechanism"]), decode_events(meta["events"])
    except Exception:
        return None


# ----- opaque local state (context.state) -------------------------------------------------------
STATE_STYPE = "protofl.torch-save"
"""The ``stype`` of a packed client state: its bytes are ``torch.save``'s, as they are."""


def state_bytes(state: Mapping[str, Any]) -> bytes:
    """``torch.save`` bytes of a client state (what :func:`pack_state` packs and a node file
    holds)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def pack_state(state: Mapping[str, Any] | bytes) -> ArrayRecord:
    """Arbitrary torch-serialisable state (tensors, plain containers), or its
    :func:`state_bytes`, as a one-entry ArrayRecord.

    The ``torch.save`` bytes are the array's data as they are (``stype``
    :data:`STATE_STYPE`, a uint8 vector), so Flower chunks them like any array and nothing
    copies them again.  Used only for a client's ``context.state``, which never leaves its node.
    """
    data = state if isinstance(state, bytes) else state_bytes(state)
    array = Array(dtype="uint8", shape=(len(data),), stype=STATE_STYPE, data=data)
    return ArrayRecord({"state": array})


def packed_bytes(record: ArrayRecord) -> bytes:
    """The ``torch.save`` bytes a :func:`pack_state` record holds (also of a state packed as a
    numpy uint8 array, before :data:`STATE_STYPE`)."""
    array = record["state"]
    return array.data if array.stype == STATE_STYPE else array.numpy().tobytes()


def unpack_state(record: ArrayRecord) -> dict[str, Any]:
    """Inverse of :func:`pack_state` (``weights_only`` loading: no code is unpickled)."""
    return load_state_bytes(packed_bytes(record))


def load_state_bytes(data: bytes) -> dict[str, Any]:
    """A state from ``torch.save`` bytes (``weights_only``: no code is unpickled)."""
    out: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return out


def finite_metrics(values: Mapping[str, float | int | None]) -> MetricRecord:
    """A MetricRecord of the finite numeric entries (None and NaN are left out)."""
    out: dict[str, float | int] = {}
    for key, value in values.items():
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        out[key] = value
    return MetricRecord(out)  # type: ignore[arg-type]
