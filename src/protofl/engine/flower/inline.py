"""``InlineGrid``: Flower's Grid contract served in-process, without Ray or a SuperLink.

Every message goes through Flower's own wire serialisation (``recorddict_to_proto`` and back)
to a real ``ClientApp`` call with a per-node ``Context`` that persists across rounds, exactly
as a SuperNode keeps it.  A ClientApp exception becomes an error reply, as in Flower's
simulation engine.  Nodes can be told to go silent (they stay listed but never answer), so the
strategy's timeouts can be tested.

It is the ``inline`` backend of :func:`protofl.engine.flower.run.run_flower_simulation`: the
same ServerApp and ClientApp code as under Ray or a deployment, for CI and 1-2 core machines
(Ray's start-up alone takes about 12 s on two cores).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

ClientCallable = Callable[[Message, Context], Message]

CLIENT_APP_RAISED = 1  # Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def _wire(content: RecordDict) -> RecordDict:
    return recorddict_from_proto(recorddict_to_proto(content))


class InlineGrid(Grid):
    """In-process Grid over ``num_nodes`` virtual SuperNodes running ``client_app``.

    Node ids are ``1000 + partition`` unless ``node_ids`` is given (a list, one per partition).
    ``silent``: node ids that are listed but never reply (a vanished SuperNode).
    """

    def __init__(
        self,
        client_app: ClientCallable,
        num_nodes: int,
        *,
        run_config: dict[str, Any] | None = None,
        node_ids: list[int] | None = None,
        silent: Iterable[int] = (),
        run_id: int = 1,
    ) -> None:
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.run import Run
        from flwr.supercore.task_identity import TaskIdentity

        # what Flower's runtimes set before a ServerApp creates messages (process-wide)
        for attr, value in (("task_id", 1), ("run_id", run_id), ("node_id", SUPERLINK_NODE_ID)):
            if getattr(TaskIdentity, "_" + attr) is None:
                setattr(TaskIdentity, attr, value)
        self.client_app = client_app
        ids = node_ids if node_ids is not None else [1000 + p for p in range(num_nodes)]
        if len(ids) != num_nodes:
            raise ValueError("node_ids needs one id per node")
        self.contexts: dict[int, Context] = {
            nid: Context(
                run_id=run_id,
                node_id=nid,
                node_config={"partition-id": p, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for p, nid in enumerate(ids)
        }
        self.silent: set[int] = set(silent)
        self.removed: set[int] = set()
        self.replies: dict[str, Message] = {}
        self.sent: list[Message] = []
        self._run = Run.create_empty(run_id)

    # ----- Grid interface ---------------------------------------------------------------------
    def set_run(self, run: Any) -> None:
        """Set the run."""
        self._run = run

    @property
    def run(self) -> Any:
        """The run."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A new message (kept for the abstract interface)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        """Connected nodes (silent ones included, removed ones not)."""
        return [n for n in self.contexts if n not in self.removed]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver every message now; replies wait for ``pull_messages``."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self.sent.append(msg)
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            if node in self.silent or node in self.removed or node not in self.contexts:
                continue
            delivered = Message(
                content=_wire(msg.content),
                dst_node_id=node,
                message_type=msg.metadata.message_type,
                group_id=msg.metadata.group_id,
            )
            delivered.metadata.__dict__["_message_id"] = msg.metadata.message_id
            delivered.metadata.__dict__["_src_node_id"] = msg.metadata.src_node_id
            try:
                reply = self.client_app(delivered, self.contexts[node])
                reply = Message(content=_wire(reply.content), reply_to=msg)
            except Exception as exc:
                reason = f"{type(exc)}:<'{exc}'>"
                reply = Message(Error(code=CLIENT_APP_RAISED, reason=reason), reply_to=msg)
            self.replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """Replies that are ready (each returned once)."""
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Push, then pull until every reply is in or ``timeout`` seconds have passed."""
        ids = set(self.push_messages(messages))
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        out: list[Message] = []
        while True:
            got = self.pull_messages(ids)
            out.extend(got)
            ids -= {m.metadata.reply_to_message_id for m in got}
            if not ids or timeout is None or time.monotonic() >= end:
                return out
            time.sleep(min(0.05, max(end - time.monotonic(), 0.0)))
