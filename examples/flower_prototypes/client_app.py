"""ClientApp: local FedProto training, and prototypes released through ``PrototypePrivacy``.

Everything a client keeps between rounds (its model, optimiser, and the privacy object with its
ledger and DCR teacher; the secret noise key itself never leaves the process) lives in
``context.state``, which stays on the node.
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from task import CLASSES, FEAT, Net, load_partition, setting

from protofl.privacy import PrototypePrivacy

app = ClientApp()


def _setup(context: Context) -> tuple[Net, torch.optim.Optimizer, PrototypePrivacy]:
    """This client's model, optimiser and privacy object, restored from ``context.state``."""
    cfg = context.run_config
    torch.manual_seed(int(context.node_config["partition-id"]))  # initial model, per client
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    privacy = PrototypePrivacy(  # the noise key is secret: drawn here, never sent
        epsilon=setting(cfg, "epsilon"), rounds=int(setting(cfg, "num-rounds")), dim=FEAT, clip=1.0
    )
    privacy.dcr(net.head)  # VPDR's DCR on the classifier head
    if "client" in context.state:  # every round after the first
        saved = torch.load(io.BytesIO(context.state["client"]["blob"]), weights_only=True)
        net.load_state_dict(saved["net"])
        opt.load_state_dict(saved["opt"])
        privacy.load_state_dict(saved["privacy"])  # ledger, release count, DCR teacher
    return net, opt, privacy


def _save(
    context: Context, net: Net, opt: torch.optim.Optimizer, privacy: PrototypePrivacy
) -> None:
    buf = io.BytesIO()
    torch.save(
        {"net": net.state_dict(), "opt": opt.state_dict(), "privacy": privacy.state_dict()}, buf
    )
    context.state["client"] = ConfigRecord({"blob": buf.getvalue()})


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local epochs against the global prototypes, then a noisy prototype release."""
    net, opt, privacy = _setup(context)
    dcr = privacy.dcr(net.head)
    x, y, _, _ = load_partition(int(context.node_config["partition-id"]))
    arrays = msg.content["arrays"].to_torch_state_dict()
    protos = arrays.get("prototypes")
    for _ in range(2):
        for idx in torch.randperm(len(y)).split(32):
            f_raw = net.adapter(x[idx])
            f = dcr.soft_clip(f_raw) if dcr else f_raw
            logits = net.head(f)
            loss = F.cross_entropy(logits, y[idx])
            if protos is not None:
                loss = loss + F.mse_loss(f, protos[y[idx]])
            if dcr:
                loss = loss + dcr.kd_loss(f_raw, logits)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if dcr:
                dcr.after_step(net.head)
    with torch.no_grad():
        feats = net.adapter(x)
    release = privacy.release(feats, y, num_classes=CLASSES)  # clip, mean, noise; charged
    _save(context, net, opt, privacy)
    content = RecordDict(
        {
            "arrays": ArrayRecord(
                {
                    "prototypes": release.prototypes,
                    "classes": release.classes,
                    "counts": release.counts,
                }
            ),
            "metrics": MetricRecord({"epsilon": privacy.epsilon_spent()}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of this client's personalized model on its own test split."""
    net, _, privacy = _setup(context)
    dcr = privacy.dcr(net.head)
    _, _, xt, yt = load_partition(int(context.node_config["partition-id"]))
    with torch.no_grad():
        f = net.adapter(xt)
        f = dcr.soft_clip(f) if dcr else f
        acc = float((net.head(f).argmax(1) == yt).float().mean())
    metrics = MetricRecord({"accuracy": acc, "num-examples": len(yt)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
