"""Codec round trips between protofl uploads/global state and Flower records."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

from protofl.engine.flower.codec import (
    CodecError,
    claimed_partition,
    decode_global_state,
    decode_upload,
    encode_global_state,
    encode_upload,
    pack_state,
    unpack_state,
)
from protofl.methods.base import Upload
from protofl.privacy.base import Release


def wire(content: RecordDict) -> RecordDict:
    """Through Flower's protobuf serialisation and back, as on the network."""
    return recorddict_from_proto(recorddict_to_proto(content))


def make_upload(k: int = 3, d: int = 8, weights: bool = False) -> Upload:
    g = torch.Generator().manual_seed(0)
    release = Release(
        prototypes=torch.randn(k, d, generator=g),
        classes=torch.tensor([0, 2, 2][:k]),
        counts=torch.tensor([5, 7, 1][:k]),
        sensitivity=torch.tensor([0.4, 0.3, 2.0][:k]),
        noise_std=torch.rand(k, d, generator=g),
        mechanism="vpp",
        events=[{"kind": "pure", "epsilon": 0.1}, {"kind": "gaussian", "noise_multiplier": 3.5}],
        info={"sigma": 3.5, "k": 3.0},
        diagnostics={"partition_overlap": 0.25},
    )
    w = {"head.weight": torch.randn(4, d, generator=g), "head.bias": torch.zeros(4)}
    return Upload(
        client=1, domain=2, release=release, num_samples=13, weights=w if weights else None
    )


def assert_same_upload(a: Upload, b: Upload) -> None:
    assert (a.client, a.domain, a.num_samples) == (b.client, b.domain, b.num_samples)
    assert (a.release is None) == (b.release is None)
    if a.release is not None and b.release is not None:
        for key in ("prototypes", "classes", "counts", "sensitivity", "noise_std"):
            x, y = getattr(a.release, key), getattr(b.release, key)
            assert x.dtype == y.dtype and torch.equal(x, y), key
        assert a.release.mechanism == b.release.mechanism
        assert a.release.events == b.release.events
        assert a.release.info == b.release.info
    assert (a.weights is None) == (b.weights is None)
    if a.weights is not None and b.weights is not None:
        assert a.weights.keys() == b.weights.keys()
        for k in a.weights:
            assert torch.equal(a.weights[k], b.weights[k])


@pytest.mark.parametrize("weights", [False, True])
def test_upload_round_trip_through_the_wire(weights: bool) -> None:
    up = make_upload(weights=weights)
    back = decode_upload(wire(encode_upload(up)))
    assert_same_upload(up, back)


def test_upload_without_release_and_empty_release() -> None:
    up = Upload(client=0, domain=-1, release=None, num_samples=4)
    assert_same_upload(up, decode_upload(wire(encode_upload(up))))
    empty = Release(
        prototypes=torch.zeros(0, 8),
        classes=torch.zeros(0, dtype=torch.long),
        counts=torch.zeros(0, dtype=torch.long),
        sensitivity=torch.zeros(0),
        noise_std=torch.zeros(0, 8),
        mechanism="vpp",
    )
    up = Upload(client=0, domain=0, release=empty, num_samples=0)
    assert_same_upload(up, decode_upload(wire(encode_upload(up))))


def test_server_mapping_overrides_claimed_partition() -> None:
    content = encode_upload(make_upload())
    assert claimed_partition(content) == 1
    assert decode_upload(content, client=5).client == 5


def test_global_state_round_trip() -> None:
    state = {
        "prototypes": torch.randn(3, 8),
        "classes": torch.tensor([0, 1, 4]),
        "__weights_round": torch.tensor(2),
        "mask": torch.tensor([True, False]),
        "table": torch.randn(2, 3, 8, dtype=torch.float64),
    }
    back = decode_global_state(
        ArrayRecord(dict(wire(RecordDict({"g": encode_global_state(state)}))["g"]))
    )
    assert back.keys() == state.keys()
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
    assert decode_global_state(encode_global_state({})) == {}


def test_local_state_pack_round_trip() -> None:
    state = {"model": {"w": torch.randn(2, 2)}, "ledger": {"entries": [{"round": 0}]}, "n": 3}
    back = unpack_state(pack_state(state))
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["ledger"] == state["ledger"] and back["n"] == 3


def test_a_packed_state_holds_torch_saves_bytes_once_and_the_old_form_still_reads() -> None:
    import io

    import numpy as np
    from flwr.app import Array, ArrayRecord

    from protofl.engine.flower.codec import STATE_STYPE

    state = {"model": {"w": torch.randn(64, 64)}, "n": 3}
    packed = pack_state(state)["state"]
    buf = io.BytesIO()
    torch.save(state, buf)
    assert packed.stype == STATE_STYPE and packed.data == buf.getvalue()
    assert tuple(packed.shape) == (len(buf.getvalue()),) and packed.dtype == "uint8"
    old = ArrayRecord({"state": Array(np.frombuffer(buf.getvalue(), dtype=np.uint8).copy())})
    assert torch.equal(unpack_state(old)["model"]["w"], state["model"]["w"])


def _broken(mutate) -> str:  # type: ignore[no-untyped-def]
    content = encode_upload(make_upload())
    mutate(content)
    with pytest.raises(CodecError) as info:
        decode_upload(content)
    return str(info.value)


def test_malformed_records_are_rejected_with_a_reason() -> None:
    assert "no 'upload'" in _broken(lambda c: c.pop("upload"))
    assert "no 'release'" in _broken(lambda c: c.pop("release"))
    assert "keys" in _broken(lambda c: c["release"].pop("counts"))
    assert "'domain'" in _broken(lambda c: c["upload"].__setitem__("domain", "red"))
    assert "events" in _broken(lambda c: c["upload"].__setitem__("events", "{not json"))
    assert "inconsistent release" in _broken(
        lambda c: c["release"].__setitem__("counts", Array(torch.ones(5, dtype=torch.long).numpy()))
    )
    assert "ArrayRecord" in _broken(lambda c: c.__setitem__("release", ConfigRecord({"a": 1})))


def test_decoded_non_finite_values_reach_validation_not_aggregation() -> None:
    from protofl.methods.validation import validate_upload

    up = make_upload()
    assert up.release is not None
    up.release.prototypes[0, 0] = math.nan
    back = decode_upload(encode_upload(up))
    reason = validate_upload(back, declared_domain=2, num_classes=3, dim=8)
    assert reason is not None and "NaN" in reason
