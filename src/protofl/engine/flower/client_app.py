"""The Flower ``ClientApp``: one protofl client per SuperNode, built from the run config.

The client is the very object the in-process simulator uses: the app builds a
:class:`~protofl.engine.simulation.Simulation` from the experiment config (once per process,
see *Caching* below) and drives ``sim.clients[partition_id]`` with the simulator's own
``collect_uploads`` (model features -> privacy mechanism -> ledger), ``train_client`` and the
same evaluation, so both engines run the same code.

Messages (the strategy sends them in this order every round):

* ``query.hello``: which partition, domain, how many samples; no data leaves.
* ``train.release``: features of the current model go through the configured privacy mechanism
  **on the client**; only the noisy release leaves (LDP: the server never sees an un-noised
  prototype).  The client's ledger is charged before the reply is sent.
* ``train``: local epochs against the broadcast global state; replies the mean loss (and the
  model weights, for methods that share them).
* ``evaluate``: loads averaged weights if any, evaluates on the client's test set (the whole
  set, its fixed subsample of ``federation.eval_samples``, or not at all in a round that
  ``federation.eval_every`` skips: ``config["evaluation"]``).

State across rounds: everything mutable (model, optimiser, method ``ClientState``, DCR teacher,
privacy ledger, RNG states, mechanism counters) is saved into ``context.state["protofl"]``
after every message and restored before the next, so it survives Flower's ephemeral ClientApps
(and Ray actors that move a partition between processes).  With a state folder (the node
config's ``state-dir``, or in protofl's own simulation one folder per partition under the run
folder) it is also written to disk, so a restarted node goes on from it.

A release is made once per round: the client keeps its last release (the reply as sent) and
its state right after it.  A server that asks again for the same round (it restarted from its
checkpoint of the round before) gets the very same release, and the client's training state
goes back to just after that release; nothing is drawn, charged or counted twice, and the
ledger, noise stream and release counter never go back.

Caching: the immutable part (the config, the federated data and the simulator skeleton) is
cached per process, keyed by the config; building it costs a data-set load, which for a real
deployment happens once per ClientApp process.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from protofl.config import ExperimentConfig
from protofl.engine.flower.codec import (
    DIAGNOSTIC_RECORD,
    check_wire,
    decode_global_state,
    encode_upload,
    finite_metrics,
    load_state_bytes,
    pack_state,
    packed_bytes,
    record_to_tensors,
    state_bytes,
)
from protofl.engine.simulation import Client, Simulation
from protofl.methods.base import Upload, frozen_parameter_names
from protofl.privacy.noise import INSECURE_OPT_OUT, resolve_noise_mode

log = logging.getLogger(__name__)

STATE_KEY = "protofl"
"""Key of the client's saved state in ``context.state``."""

STATE_DIR_KEY = "state-dir"
"""Node-config key: a folder on the node where the client keeps its state (model, ledger,
release counters, noise key and stream) across SuperNode restarts; never sent anywhere."""

CONFIG_KEY = "protofl-config"
"""Run-config key holding the experiment config as JSON."""

OVERRIDES_KEY = "protofl-set"
"""Run-config key holding ``;``-separated ``key=value`` overrides applied on top."""


def config_from_run_config(run_config: Any) -> ExperimentConfig:
    """The experiment config carried by a Flower run config: ``protofl-config`` JSON, the typed
    keys of a generated app over it (``rounds``, ``epsilon``, ...:
    :data:`protofl.engine.flower.app.TYPED_KEYS`), then ``protofl-set`` overrides."""
    from protofl.engine.flower.app import apply_typed_keys

    if CONFIG_KEY not in run_config:
        raise ValueError(
            f"the Flower run config has no {CONFIG_KEY!r}; generate the app with "
            "`protofl flower-app OUT_DIR CONFIG` or pass the config to make_client_app"
        )
    config = ExperimentConfig.from_dict(json.loads(str(run_config[CONFIG_KEY])), source=CONFIG_KEY)
    config = apply_typed_keys(config, run_config)
    overrides = [s.strip() for s in str(run_config.get(OVERRIDES_KEY, "")).split(";")]
    return config.with_overrides([s for s in overrides if s])


def config_key(config: ExperimentConfig) -> str:
    """A stable key for a config (its canonical JSON); kept for the config objects seen last
    (a config is frozen, and every message of a run asks again)."""
    hit = _CONFIG_KEYS.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    key = json.dumps(config.to_dict(), sort_keys=True)
    if len(_CONFIG_KEYS) >= 16:
        _CONFIG_KEYS.clear()
    _CONFIG_KEYS[id(config)] = (config, key)
    return key


_CONFIG_KEYS: dict[int, tuple[ExperimentConfig, str]] = {}


@dataclass
class ClientRuntime:
    """The per-process, immutable part of the clients: config, data, simulator skeleton."""

    config: ExperimentConfig
    sim: Simulation
    initial: dict[int, dict[str, Any]]


_RUNTIMES: dict[tuple[str, str], ClientRuntime] = {}
_LOCK = threading.Lock()


def get_runtime(config: ExperimentConfig, home: Path | None = None) -> ClientRuntime:
    """The cached runtime for ``config`` (built on first use in this process)."""
    from protofl.data.cache import protofl_home
    from protofl.engine.federated_data import build_federated_data

    home = Path(home) if home is not None else protofl_home()
    key = (config_key(config), str(home))
    with _LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            data = build_federated_data(config, home)
            sim = Simulation(config, data)
            initial: dict[int, dict[str, Any]] = {}
            shared: dict[Any, list[torch.Tensor]] = {}
            for c in sim.clients:
                initial[c.data.client] = _initial_state(client_state(sim, c), shared)
                unload_client(sim, c)  # with run.client_state=disk: rows read leave RSS
            runtime = ClientRuntime(config=config, sim=sim, initial=initial)
            _RUNTIMES.clear()  # one experiment per process at a time; free the last one
            _RUNTIMES[key] = runtime
    return runtime


# ----- one client's mutable state -----------------------------------------------------------
def _initial_state(
    state: dict[str, Any],
    seen: dict[Any, list[torch.Tensor]],
    parts: tuple[str, ...] = ("model", "dcr"),
) -> dict[str, Any]:
    """A private copy of a client's initial ``state`` (:func:`client_state`, whose tensors are
    the client's live ones: a state_dict aliases them, and a run would mutate them in place, so
    the next run in this process would start elsewhere).

    Each tensor of its ``parts`` equal to one already ``seen`` at the same place in another
    client's initial state is that one; any other is cloned (its own storage only: with
    ``run.client_state=disk`` it is a row of the mapped store, whose deep copy copies the whole
    store) and recorded in ``seen``. Clients whose fresh models are identical
    (``Backbone.client_model_key``) then hold one copy of their initial values, so the
    runtime's initial states grow with the distinct values, not with M (a frozen 1280 -> 512
    projection alone is 2.6 MB a client). They are read only: :func:`fresh_client_state` hands
    them on, :func:`load_client_state` copies them into the client's modules.

    Nothing is cloned only to be dropped: at 10,000 clients a clone of each client's model,
    freed once found equal, left 6.7-8.3 GB of heap resident (the small copies kept for every
    client sat between the freed blocks)."""

    def share(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            # candidates by a cheap key (clients with distinct values compare with few)
            key = (path, obj.dtype, tuple(obj.shape), tuple(obj.flatten()[:16].tolist()))
            same = [t for t in seen.setdefault(key, []) if torch.equal(t, obj)]
            if same:
                return same[0]
            own = obj.detach().clone()
            seen[key].append(own)
            return own
        if isinstance(obj, dict):
            return {k: share(v, f"{path}.{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(share(v, f"{path}[{i}]") for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    return {
        k: share(v, k) if k in parts else own_storage(v, private=True) for k, v in state.items()
    }


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def client_state(
    sim: Simulation, c: Client, initial: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything one client changes across rounds (the per-client part of
    ``Simulation.state_dict``, plus its mechanism counters).  With ``initial`` (the client's
    state at the start of the run) a frozen parameter still equal to its initial value is left
    out; :func:`load_client_state` takes it from ``initial``.  The tensors are the client's live
    ones: serialise the state at once, or deep-copy it to keep it."""
    model = c.model.state_dict()
    if initial is not None:
        for name in frozen_parameter_names(c.model):
            if name in model and _equal(model[name], initial["model"][name]):
                del model[name]
    return {
        "model": dict(model),
        "optimizer": c.optimizer.state_dict(),
        "state": dict(c.state.tensors),
        "train_gen": c.train_gen.get_state(),
        # ledger, the noise key's state (never a secret key), DCR, its mechanism entries
        **c.privacy.state_dict(mechanism=True),
        "public_count": sim.public_counts.get(c.data.client),
    }


def own_storage(obj: Any, private: bool = False) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every tensor that views part of a larger
    storage copied out: ``torch.save`` writes a tensor's whole storage, and with
    ``federation.execution: batched`` a client's parameters, moments and DCR teacher are rows
    of the stacked ``[M, ...]`` store of every client in the process.

    ``private``: a deep copy in the same walk (every tensor cloned, everything else
    deep-copied), where ``copy.deepcopy`` of a row would copy the whole store."""
    if isinstance(obj, torch.Tensor):
        whole = obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        return obj if whole and obj.is_contiguous() and not private else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: own_storage(v, private) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(own_storage(v, private) for v in obj)
    return copy.deepcopy(obj) if private else obj


COPIED_ON_LOAD = ("model", "dcr")
"""Parts of a client state :func:`load_client_state` copies into the client's modules (never
takes over), so a state loaded once may share them with another."""

NOT_LOADED = ("release_cache", "noise_key")
"""Parts of a saved state :func:`load_client_state` does not read (:func:`_run` does)."""


def load_client_state(
    sim: Simulation, c: Client, state: dict[str, Any], initial: dict[str, Any] | None = None
) -> None:
    """Inverse of :func:`client_state` (``initial``: where the left-out frozen parameters come
    from).  The client takes ``state``'s tensors over (the optimiser's moments, the method's
    state): pass a private copy, such as a freshly unpacked state, whose tensors nothing else
    holds (the release cache is kept as bytes, :func:`release_cache`, so it cannot alias them)."""
    model = state["model"]
    if initial is not None:
        model = {**{k: v for k, v in initial["model"].items() if k not in model}, **model}
    load_model_state(c, model)
    c.optimizer.load_state_dict(state["optimizer"])
    c.state.tensors = dict(state["state"])
    c.train_gen.set_state(state["train_gen"])
    # a secret key is never in a saved state: the client keeps this process's own key; the
    # process serves one client at a time, so the mechanism keeps only this one's entries
    c.privacy.load_state_dict(state, where=f"client {c.data.name}", alone=True)
    if state.get("public_count") is not None:
        sim.public_counts[c.data.client] = int(state["public_count"])
    else:
        sim.public_counts.pop(c.data.client, None)


def load_model_state(c: Client, model: dict[str, torch.Tensor]) -> None:
    """``c.model.load_state_dict(model)`` (strict), leaving a frozen parameter that already
    holds the value to load alone: a copy in place would change its version, and the batched
    trainer's ``proj(z)`` caches, keyed by it, would start again with every message."""
    live = c.model.state_dict()
    kept = {k for k in frozen_parameter_names(c.model) if k in model and _equal(live[k], model[k])}
    missing, unexpected = c.model.load_state_dict(
        {k: v for k, v in model.items() if k not in kept}, strict=False
    )
    if set(missing) != kept or unexpected:
        raise ValueError(
            f"client {c.data.name!r}: the model state to load does not fit its model (missing "
            f"{sorted(set(missing) - kept)}, unexpected {sorted(unexpected)})"
        )


def unload_client(sim: Simulation, c: Client) -> None:
    """Drop what ``c`` holds in the process's simulator skeleton beyond its model: optimiser
    moments and method state, which every message loads afresh from the client's saved state
    (:func:`load_client_state`), so they would only be a second copy, kept for every client the
    process ever served, and the gradients of its last step (every step zeroes them first).
    With ``run.client_state=disk`` its rows of the mapped store leave the resident set as
    well."""
    c.optimizer.state.clear()
    c.optimizer.zero_grad(set_to_none=True)
    c.state.tensors = {}
    sim.page_out([c])


def node_flag(node_config: Any, key: str) -> bool:
    """A boolean node-config entry (``true``/``1``/``yes``, or a bool)."""
    value = node_config.get(key, False)
    return value is True or str(value).strip().lower() in ("true", "1", "yes")


def load_node_state(path: Path) -> dict[str, Any] | None:
    """The client state saved on this node by :func:`save_node_state` (None if there is none)."""
    loaded = _read_node_state(path)
    return None if loaded is None else loaded[0]


def _read_node_state(path: Path) -> tuple[dict[str, Any], bytes] | None:
    """:func:`load_node_state` and the file's bytes."""
    if not path.exists():
        return None
    data = path.read_bytes()
    try:
        return load_state_bytes(data), data
    except Exception as exc:
        raise ValueError(f"{path}: the node's saved client state cannot be read ({exc})") from None


def save_node_state(path: Path, data: bytes) -> None:
    """Write a client state's :func:`~protofl.engine.flower.codec.state_bytes` atomically into
    the node's state folder, readable by the node's user alone (mode 0600 from creation: in
    secret mode it holds the noise key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


PRIVATE_PARTS = ("ledger", "noise_gen", "mechanism", "public_count", "noise_key")
"""Parts of a client's state a repeated release never rolls back (what it released, charged
and drew); the rest (model, optimiser, method state, batch order, DCR teacher) does."""


def encode_reply(content: RecordDict) -> torch.Tensor:
    """A reply as Flower's wire bytes (a uint8 tensor, kept in the client's own state)."""
    from flwr.common.serde import recorddict_to_proto

    data = recorddict_to_proto(content).SerializeToString()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode_reply(data: torch.Tensor) -> RecordDict:
    """Inverse of :func:`encode_reply`."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    return recorddict_from_proto(ProtoRecordDict.FromString(data.numpy().tobytes()))


def release_cache(rnd: int, content: RecordDict) -> dict[str, Any]:
    """What a client keeps of its release in round ``rnd``: the reply (as bytes) and its state
    after it.  That state is the one saved with the cache (``after`` None) until a later
    message saves a different one; that message keeps the bytes it was saved as
    (:func:`keep_state_after_release`).  As bytes it is unpacked only if the server asks for
    the same release again, and nothing the client trains can change it in place."""
    return {"round": rnd, "reply": encode_reply(content), "after": None}


def keep_state_after_release(cache: dict[str, Any], saved_bytes: bytes) -> dict[str, Any]:
    """``cache`` holding the state after its release as bytes: ``saved_bytes``, the state saved
    with it, when it held none (the saved state was that state)."""
    if not cache or cache.get("after") is not None:
        return cache
    return {**cache, "after": torch.frombuffer(bytearray(saved_bytes), dtype=torch.uint8)}


def forget_state_after_release(cache: dict[str, Any]) -> dict[str, Any]:
    """``cache`` keeping no state after its release (``after`` False) once the state changes,
    for a simulated node without node files: its server has no checkpoint to restart from, so
    it never asks for the same release again, and a request that does is refused
    (:func:`cached_state_after_release`) instead of answered with another state."""
    if not cache or cache.get("after") is not None:
        return cache
    return {**cache, "after": False}


def release_file(path: Path, rnd: int) -> Path:
    """Where a node whose state lives in ``path`` alone keeps the state it saved with its
    round-``rnd`` release, once a later message replaces ``path`` (:func:`keep_release_file`)."""
    return path.with_name(f"{path.name}.release-{rnd}")


def keep_release_file(cache: dict[str, Any], path: Path, saved_bytes: bytes) -> dict[str, Any]:
    """:func:`keep_state_after_release` for a node of protofl's simulation, whose node files
    are this machine's: the file the release saved (``saved_bytes``, read from it or from the
    node's Context), still at ``path``, is hard-linked to :func:`release_file` and the cache
    names it, so those bytes are neither kept in the Context nor written a second time into
    every later node file of the round.  Where the file system has no hard links, or the file
    is gone or not of ``saved_bytes``' size, the cache holds the bytes."""
    if not cache or cache.get("after") is not None:
        return cache
    link = release_file(path, int(cache["round"]))
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        if path.stat().st_size != len(saved_bytes):  # not the state the release saved
            return keep_state_after_release(cache, saved_bytes)
        os.link(path, tmp)
    except OSError:
        return keep_state_after_release(cache, saved_bytes)
    os.replace(tmp, link)
    return {**cache, "after": link.name}


def drop_release_files(path: Path) -> None:
    """Remove the release files of ``path``'s earlier releases (:func:`release_file`): called
    once ``path`` holds a new release, whose cache names none of them."""
    for old in path.parent.glob(f"{path.name}.release-*"):
        old.unlink(missing_ok=True)


def _state_bytes(state: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(state_bytes(state)), dtype=torch.uint8)


def cached_release(saved: dict[str, Any]) -> dict[str, Any]:
    """The release cache of a saved state (a cache saved as a dict, before the state after the
    release was kept as bytes, may share tensors with the saved state: it is turned into bytes
    here, before anything trains)."""
    cache: dict[str, Any] = saved.get("release_cache") or {}
    if isinstance(cache.get("after"), dict):
        cache = {**cache, "after": _state_bytes(cache["after"])}
    return cache


def cached_state_after_release(
    cache: dict[str, Any], saved: dict[str, Any], folder: Path | None = None
) -> dict[str, Any]:
    """The parts of the state after the cached release that a repeated release restores (not
    :data:`PRIVATE_PARTS`), unpacked afresh; ``saved`` when the cache holds no bytes (the saved
    state is the state after the release); read from the release file in ``folder`` (the node
    file's) when the cache names one (:func:`keep_release_file`); refused when it kept none
    (:func:`forget_state_after_release`)."""
    after = cache.get("after")
    if after is False:
        raise ValueError(
            f"round {cache.get('round')}: the release is asked for again, but the state after "
            "it was not kept (a Flower simulation without a run folder has no checkpoint to "
            "restart from)"
        )
    if isinstance(after, str):
        if Path(after).name != after:
            raise ValueError(f"{after!r}: a release file is named within its node's folder")
        if folder is None or not (folder / after).is_file():
            where = after if folder is None else folder / after
            raise ValueError(
                f"{where}: the state saved with the round-{cache.get('round')} release, which "
                "the node file's release cache names, is missing"
            )
        state = load_state_bytes((folder / after).read_bytes())
    else:
        state = saved if after is None else load_state_bytes(after.numpy().tobytes())
    return {k: v for k, v in state.items() if k not in PRIVATE_PARTS and k not in NOT_LOADED}


def fresh_client_state(
    sim: Simulation, runtime_initial: dict[str, Any], mode: str
) -> dict[str, Any]:
    """A client's state at its first start: the config's initial state, marked as using a
    ``secret`` noise key (drawn on this node from the operating system when the state is
    loaded, held in the process's memory only; never derived from the config, never saved).

    The model and the DCR teacher are the runtime's own tensors (:data:`COPIED_ON_LOAD`:
    :func:`load_client_state` copies them into the client's modules and nothing writes them),
    the rest a private deep copy: a client with no saved state is loaded at every message that
    reaches it (each ``hello``, each evaluation of a client never selected to train)."""
    state = {k: v if k in COPIED_ON_LOAD else copy.deepcopy(v) for k, v in runtime_initial.items()}
    if mode == "secret":
        state["noise_gen"] = {"mode": "secret", "draws": 0}
    state["noise_key"] = mode
    return state


def evaluate_client(sim: Simulation, c: Client, sample: bool = False) -> tuple[float, int]:
    """One client's accuracy on its domain's test set, or (``sample``) on the set's fixed
    subsample of ``federation.eval_samples`` (:meth:`Simulation.evaluate` of this client: with
    ``federation.execution: batched`` the batched predictor, whose ``proj(z)`` of a frozen
    projection is computed once per test set in the process, not once per message), and the
    number of test samples it was measured on."""
    return sim.evaluate(sample, [c])[c.data.name], len(sim.test_set(c, sample)[1])


def evaluate_client_holdout(sim: Simulation, c: Client) -> float | None:
    """One client's accuracy on the held-out domain (``Simulation.evaluate_holdout``'s term)."""
    return sim.evaluate_holdout([c])


# ----- the app ------------------------------------------------------------------------------
Handler = Callable[[Simulation, Client, Message], RecordDict]


def _server_round(msg: Message) -> int:
    cfg = msg.content.get("config", ConfigRecord())
    return int(cfg.get("server-round", 0))  # type: ignore[arg-type]


def _hello(sim: Simulation, c: Client, msg: Message) -> RecordDict:
    d = c.data
    return RecordDict(
        {
            "hello": ConfigRecord(
                {
                    "partition-id": d.client,
                    "name": d.name,
                    "domain": d.domain,
                    "domain-name": d.domain_name,
                    **(
                        {"num-samples": d.num_train}
                        if sim.counts_public
                        else {}  # add_remove with noisy counts: the exact count stays here
                    ),
                    "num-test": len(d.test_y),
                    "num-clients": len(sim.clients),
                    "num-classes": sim.data.num_classes,
                    "num-domains": len(sim.data.domains),
                    "has-holdout": sim.data.holdout is not None,
                    "method": sim.method.name,
                    "mechanism": sim.mechanism.name,
                    "noise-key": sim.noise_mode,
                }
            )
        }
    )


def _release(sim: Simulation, c: Client, msg: Message) -> RecordDict:
    active = [other is c for other in sim.clients]
    (upload,) = sim.collect_uploads(active)  # privacy mechanism applied, ledger charged
    sim.releases.clear()
    content = encode_upload(upload)
    content["metrics"] = finite_metrics(
        {"num-examples": upload.num_samples, "client-epsilon": c.privacy.epsilon_spent()}
    )
    if sim.diagnostics and upload.release is not None and upload.release.diagnostics:
        content[DIAGNOSTIC_RECORD] = finite_metrics(upload.release.diagnostics)
    return content


def _train(sim: Simulation, c: Client, msg: Message) -> RecordDict:
    sim.global_state = decode_global_state(msg.content.get("global", ArrayRecord()))
    loss = sim.train_client(c)
    weights = None
    if sim.method.shares_weights:
        weights = {k: v.detach().clone() for k, v in c.model.state_dict().items()}
    upload = Upload(
        client=c.data.client,
        domain=c.data.domain,
        release=None,
        num_samples=sim.public_count(c),
        weights=weights,
    )
    content = encode_upload(upload)
    content["metrics"] = MetricRecord({"num-examples": upload.num_samples})
    if sim.diagnostics:  # the training loss is computed on private data: simulation only
        content[DIAGNOSTIC_RECORD] = finite_metrics({"train-loss": float(loss)})
    return content


def _evaluate(sim: Simulation, c: Client, msg: Message) -> RecordDict:
    sim.global_state = decode_global_state(msg.content.get("global", ArrayRecord()))
    if "weights" in msg.content:
        load_model_state(c, record_to_tensors(msg.content["weights"], "weights"))
    plan = str(msg.content.get("config", ConfigRecord()).get("evaluation", "full"))
    if plan not in ("full", "sample", "none"):
        raise ValueError(f"config['evaluation'] is {plan!r}, not one of full, sample, none")
    if plan == "none":  # federation.eval_every: the weights only, no accuracy this round
        return RecordDict({"metrics": MetricRecord({"partition-id": c.data.client})})
    acc, tested = evaluate_client(sim, c, sample=plan == "sample")
    metrics: dict[str, Any] = {
        "partition-id": c.data.client,
        "accuracy": acc,
        "num-examples": tested,
    }
    holdout = evaluate_client_holdout(sim, c)
    if holdout is not None:
        metrics["holdout-accuracy"] = holdout
    return RecordDict({"metrics": MetricRecord(metrics)})


def _run(
    handler: Handler,
    phase: str,
    msg: Message,
    context: Context,
    config: ExperimentConfig | None,
    home: Path | None,
    deployment: bool,
    state_root: Path | None = None,
    release_limit: int | None = None,
    release_files: bool = False,
) -> Message:
    cfg = config if config is not None else config_from_run_config(context.run_config)
    # the noise key is this node's decision: the server's config cannot make it derived
    mode = resolve_noise_mode(
        cfg.privacy.noise_seed,
        deployment=deployment,
        opt_out=node_flag(context.node_config, INSECURE_OPT_OUT),
    )
    runtime = get_runtime(cfg, home)
    sim = runtime.sim
    sim.noise_mode = mode
    # local-only diagnostics reach the server only in protofl's simulation, and only when the
    # run opts in (run.diagnostics; the guarantee then lists them as not covered)
    sim.diagnostics = not deployment and cfg.run.diagnostics
    # releases per client: the calibrated rounds, unless this node's own operator extended
    # the run (never a value the server sends); reset for every run the process serves
    limit = release_limit or cfg.federation.rounds
    if sim.mechanism.rounds != limit:
        from protofl.engine.extension import raise_release_limit

        sim.mechanism.rounds = cfg.federation.rounds
        raise_release_limit(sim.mechanism, limit)
    pid = int(context.node_config.get("partition-id", -1))  # type: ignore[call-overload]
    if not 0 <= pid < len(sim.clients):
        raise ValueError(
            f"node {context.node_id}: partition-id {pid} is outside 0..{len(sim.clients) - 1} "
            "(set it with --node-config 'partition-id=N num-partitions=M')"
        )
    c = sim.clients[pid]
    rnd = _server_round(msg)
    state_dir = str(context.node_config.get(STATE_DIR_KEY, "") or "")
    if not state_dir and state_root is not None:
        state_dir = str(Path(state_root) / f"partition-{pid}")
    # one file per (experiment, partition): a different experiment on this node starts afresh
    tag = hashlib.sha256(config_key(cfg).encode()).hexdigest()[:12]
    state_file = Path(state_dir) / f"protofl-client-{pid}-{tag}.pt" if state_dir else None
    # run.client_state=disk in protofl's simulation: the state file is the client's only saved
    # state (its Context holds none), so a process simulating many nodes keeps no client's
    # state between messages; a deployed node (one client) keeps both, as a lost file must
    # not restart its ledger and noise stream
    in_context = deployment or not (cfg.run.client_state == "disk" and state_file is not None)
    # where the state saved with a release is kept once a later message changes the state (a
    # restarted server's repeated release goes back to it): in protofl's simulation on this
    # machine, as that node file, hard-linked, and without node files (no run folder, so no
    # server restart) nowhere; a deployed node's Context, or a Ray cluster's, keeps its bytes
    simulated = release_files and not deployment
    link_release = simulated and state_file is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.run.threads or 1)
    try:
        saved: dict[str, Any] | None = None
        saved_bytes = b""
        if STATE_KEY in context.state:
            saved_bytes = packed_bytes(context.state[STATE_KEY])  # type: ignore[arg-type]
            saved = load_state_bytes(saved_bytes)
        elif state_file is not None and (read := _read_node_state(state_file)) is not None:
            saved, saved_bytes = read
        if saved is None:
            saved = fresh_client_state(sim, runtime.initial[pid], mode)
        elif saved.get("noise_key", mode) != mode:
            raise ValueError(
                f"node {context.node_id}: its saved client state uses the {saved['noise_key']} "
                f"noise key, this run asks for {mode}; a run never changes its noise key"
            )
        cache = cached_release(saved)
        again = phase == "release" and int(cache.get("round", -1)) == rnd
        # a repeated release request for the same round: the same release, and the training
        # state of just after it (ledger, noise stream and counters stay where they are)
        initial = runtime.initial[pid]
        folder = None if state_file is None else state_file.parent
        loaded = {**saved, **cached_state_after_release(cache, saved, folder)} if again else saved
        load_client_state(sim, c, loaded, initial)
        sim.round = max(rnd - 1, 0)
        try:
            if again:
                content = decode_reply(cache["reply"])
            else:
                if phase == "release" and deployment:
                    _charge_node_ledger(sim, c, context, tag, rnd)
                content = handler(sim, c, msg)
            check_wire(phase, content, diagnostics=sim.diagnostics)
        except Exception as exc:
            raise RuntimeError(
                f"client {c.data.name!r} (partition {pid}), round {rnd}, {phase}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        # hello and an evaluation without averaged weights to adopt change no client state
        # (the simulator's federation.eval_every rests on it too): a saved state stays as it
        # is, and a fresh one is not saved (it is rebuilt by the next message; a secret noise
        # key is never saved: a cross-device federation's clients that never train never
        # write a state)
        unchanged = phase == "hello" or (phase == "evaluate" and "weights" not in msg.content)
        if unchanged:
            return Message(content=content, reply_to=msg)
        # serialised below, before anything changes the client again: no copies, but of rows
        # of a batched store (own_storage)
        state = {**own_storage(client_state(sim, c, initial)), "noise_key": mode}
        released = phase == "release" and not again
        if released:
            cache = release_cache(rnd, content)
        elif not again and link_release and state_file is not None:
            # the state after the release changes now: the file the release saved is kept
            cache = keep_release_file(cache, state_file, saved_bytes)
        elif not again and simulated:
            cache = forget_state_after_release(cache)
        elif not again:  # ... or (deployed, a Ray cluster, no files) the bytes it was saved as
            cache = keep_state_after_release(cache, saved_bytes)
        state["release_cache"] = cache or None
        # serialised once; the node file first: a Context holding a state means its node file
        # holds it too (a release file is linked from it), even when the write fails
        data = state_bytes(state)
        packed = pack_state(data) if in_context else None
        if state_file is not None:
            save_node_state(state_file, data)
            if released and link_release:
                drop_release_files(state_file)
        if packed is not None:
            context.state[STATE_KEY] = packed
    finally:
        unload_client(sim, c)
        torch.set_num_threads(threads)
    return Message(content=content, reply_to=msg)


def _charge_node_ledger(sim: Simulation, c: Client, context: Context, run: str, rnd: int) -> None:
    """A deployed node charges the release it is about to make to its own ledger of this data
    partition, across every run (:mod:`protofl.privacy.node_ledger`), and refuses it past the
    node's budget, before anything is drawn or sent."""
    from protofl.data.cache import protofl_home
    from protofl.privacy.node_ledger import NodeLedger, data_fingerprint

    if not sim.mechanism.is_private or c.privacy.sent is not None:
        return  # release_schedule=once: a client that has released re-sends it, uncharged
    fingerprint = data_fingerprint(sim.data.dataset, c.data.domain_name, c.data.train_indices)
    ledger = NodeLedger.for_node(
        context.node_config,
        fingerprint,
        accountant=sim.config.privacy.accountant,
        default_folder=protofl_home() / "node-ledgers",
    )
    events = sim.mechanism.release_events(len(c.privacy.ledger.entries))
    ledger.charge(run, rnd, sim.mechanism.name, events)


def make_client_app(
    config: ExperimentConfig | None = None,
    home: Path | None = None,
    *,
    deployment: bool | None = None,
    state_root: Path | None = None,
    release_limit: int | None = None,
    release_files: bool = False,
) -> ClientApp:
    """A ClientApp running protofl's client; ``config`` None: read it from the run config
    (``protofl-config`` / ``protofl-set``), as apps launched by ``flwr run`` do.

    ``deployment`` (default: when ``config`` is None, i.e. the shipped app components): every
    client keeps a secret noise key (``privacy.noise_seed: derived`` is refused unless the
    node config sets ``insecure-derived-noise-key=true``) and sends no diagnostics computed on
    its private data.  protofl's own Flower simulation passes ``deployment=False``.

    ``state_root``: keep each partition's state on disk in ``state_root/partition-<id>/``
    (protofl's own simulation: ``<run folder>/nodes``; a node config's ``state-dir`` wins).
    ``release_limit``: releases each client may make (default: ``federation.rounds``, what the
    mechanism was calibrated for); an extended run raises it, on the clients' side.
    ``release_files``: protofl's simulation with node folders on this machine (inline or on a
    local Ray): the state a client saved with its release is kept as that node file,
    hard-linked (:func:`keep_release_file`), not as bytes in its Context and later node files;
    without node files (no ``state_root``: no run folder, so no server restart) it is not kept
    (:func:`forget_state_after_release`).
    """
    app = ClientApp()
    deployed = config is None if deployment is None else deployment
    extra = (state_root, release_limit, release_files)

    @app.query("hello")
    def hello(msg: Message, context: Context) -> Message:
        return _run(_hello, "hello", msg, context, config, home, deployed, *extra)

    @app.train("release")
    def release(msg: Message, context: Context) -> Message:
        return _run(_release, "release", msg, context, config, home, deployed, *extra)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _run(_train, "train", msg, context, config, home, deployed, *extra)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return _run(_evaluate, "evaluate", msg, context, config, home, deployed, *extra)

    return app
