"""ServerApp: aggregate the clients' noisy class prototypes (count-weighted mean per class)."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from task import CLASSES, FEAT, setting

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Rounds of train (release) -> aggregate; then one evaluation."""
    rounds = int(setting(context.run_config, "num-rounds"))
    nodes: list[int] = []
    while len(nodes) < int(setting(context.run_config, "num-clients")):
        nodes = list(grid.get_node_ids())
        time.sleep(0.1)
    global_state: dict[str, torch.Tensor] = {}
    for rnd in range(1, rounds + 1):
        msgs = [
            Message(
                RecordDict({"arrays": ArrayRecord(global_state)}),
                dst_node_id=n,
                message_type=MessageType.TRAIN,
                group_id=str(rnd),
            )
            for n in nodes
        ]
        sums, counts, eps = torch.zeros(CLASSES, FEAT), torch.zeros(CLASSES), []
        for reply in grid.send_and_receive(msgs):
            if reply.has_error():
                continue
            up = reply.content["arrays"].to_torch_state_dict()
            sums.index_add_(0, up["classes"], up["prototypes"] * up["counts"][:, None].float())
            counts.index_add_(0, up["classes"], up["counts"].float())
            eps.append(float(reply.content["metrics"]["epsilon"]))
        global_state = {"prototypes": sums / counts.clamp_min(1.0)[:, None]}
        print(f"round {rnd}: {len(eps)} releases, max epsilon spent {max(eps):.4f}")
    msgs = [
        Message(RecordDict(), dst_node_id=n, message_type=MessageType.EVALUATE, group_id="eval")
        for n in nodes
    ]
    accs = [float(r.content["metrics"]["accuracy"]) for r in grid.send_and_receive(msgs)]
    print("accuracy per client:", " ".join(f"{a:.3f}" for a in sorted(accs)))
