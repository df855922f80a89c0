"""A real Flower deployment on this machine's loopback: one SuperLink, N SuperNodes, ``flwr run``.

    python -m protofl.engine.flower.deploy [CONFIG] [--set K=V ...] [--workdir DIR]

starts ``flower-superlink`` and one ``flower-supernode`` per client on 127.0.0.1, writes a
Flower App for the config, runs it with ``flwr run`` against them and stops every process it
started, by its id, whether the run passed or failed.

Authenticated by default (docs/distributed.md, "Authenticated nodes"): the deployment writes a
self-signed CA and a SuperLink certificate for TLS and one ECDSA key pair per SuperNode into its
folder, starts the SuperLink with ``--enable-supernode-auth``, registers each node's public key
(``flwr supernode register``) before that node starts, and passes the resulting node id ->
partition map to the ServerApp (run config ``partition-map``), so a partition belongs to the
node holding its key.  A SuperNode whose key is not registered is refused by the SuperLink; a
registered node claiming a partition not bound to it is refused by the strategy and recorded in
``rejected``.  ``insecure=True`` (``--insecure``) runs without TLS and authentication.

Every process is started in its own session, so its process group id is its pid; stopping sends
SIGTERM to that group (the SuperLink's and SuperNodes' SuperExec and ClientApp children belong
to it), then SIGKILL to whatever is left after a grace period.  Nothing is addressed by name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protofl.config import ExperimentConfig
from protofl.engine.flower.credentials import NodeKey, TlsFiles, write_node_key, write_tls

HOST = "127.0.0.1"
CONNECTION = "protofl-loopback"
REGISTER_BATCH = 8  # `flwr supernode register` processes run at once


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {HOST}:{port} after {timeout:.0f}s")


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, read from /proc."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the command (which may hold spaces) start after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        state, pg = fields[0], int(fields[2])
        if pg == pgid and state != "Z":
            alive.append(int(entry.name))
    return alive


def _registered_id(output: str) -> int | str:
    """The node id in ``flwr supernode register --format json`` output, or why there is none."""
    try:
        reply = json.loads(output[output.index("{") :])
        if reply.get("success"):
            return int(reply["node-id"])
        lines = [ln.strip() for ln in str(reply.get("error-message", "")).splitlines()]
    except (ValueError, KeyError, TypeError, AttributeError):
        lines = [ln.strip() for ln in output.splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1] if lines else "no output"


@dataclass
class LoopbackDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1; a context manager that stops
    every process it started on exit (pass or fail).

    ``insecure=False`` (the default): TLS and SuperNode authentication, with the certificates
    in ``workdir/tls`` and the node keys in ``workdir/keys`` (written at construction);
    SuperNode ``supernode-I`` holds partition I, and :attr:`partition_map` (node id ->
    partition, filled by :meth:`start`) is passed to every run.  ``insecure=True``: plain HTTP,
    any node may connect and claim any partition (first claim wins).
    """

    workdir: Path
    num_nodes: int
    port: int = 0
    grace_s: float = 10.0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    node_config: dict[str, str] = field(default_factory=dict)
    insecure: bool = False
    register_timeout: float = 120.0
    keys: dict[str, NodeKey] = field(default_factory=dict)  # node name -> its key pair
    node_ids: dict[str, int] = field(default_factory=dict)  # registered name -> node id
    partition_map: dict[int, int] = field(default_factory=dict)  # node id -> partition

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes={self.num_nodes}: a deployment needs at least 1 node")
        self.workdir = Path(self.workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.flwr_home = self.workdir / "flwr-home"
        self.flwr_home.mkdir(exist_ok=True)
        self.tls: TlsFiles | None = None
        if self.insecure:
            transport = "insecure = true"
        else:
            self.tls = write_tls(self.workdir / "tls", (HOST, "localhost"))
            transport = f"root-certificates = {json.dumps(str(self.tls.ca_cert))}"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{HOST}:{self.port}"\n{transport}\n'
        )

    # ----- environment ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The environment of every started process (venv on PATH, private FLWR_HOME)."""
        env = dict(os.environ)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        env["FLWR_HOME"] = str(self.flwr_home)
        env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _exe(self, name: str) -> str:
        path = Path(sys.executable).parent / name
        return str(path) if path.exists() else name

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [self._exe(args[0]), *args[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            cwd=self.workdir,
            start_new_session=True,  # its own process group: pgid == pid
        )
        log.close()
        self.procs.append(proc)
        self.names.append(name)
        return proc

    # ----- lifecycle -------------------------------------------------------------------------
    def _transport_args(self, server: bool) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        if server:
            return [
                "--ssl-ca-certfile",
                str(self.tls.ca_cert),
                "--ssl-certfile",
                str(self.tls.server_cert),
                "--ssl-keyfile",
                str(self.tls.server_key),
                "--enable-supernode-auth",
            ]
        return ["--root-certificates", str(self.tls.ca_cert)]

    def start(self, timeout: float = 120.0) -> None:
        """Start the SuperLink, wait until it listens, register the SuperNodes' keys (fixing
        :attr:`partition_map`), then start the SuperNodes."""
        link = self._spawn(
            "superlink",
            [
                "flower-superlink",
                *self._transport_args(server=True),
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        _wait_port(self.port, link, timeout)
        names = [f"supernode-{i}" for i in range(self.num_nodes)]
        if self.tls is not None:
            ids = self.register(names)
            self.partition_map = {ids[name]: i for i, name in enumerate(names)}
        for i, name in enumerate(names):
            self.start_node(name, i)

    def node_key(self, name: str) -> NodeKey:
        """SuperNode ``name``'s key pair (written into ``workdir/keys`` on first use)."""
        if name not in self.keys:
            self.keys[name] = write_node_key(self.workdir / "keys", name)
        return self.keys[name]

    def _start_register(self, name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                self._exe("flwr"),
                "supernode",
                "register",
                str(self.node_key(name).public_key),
                CONNECTION,
                "--name",
                name,
                "--format",
                "json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            cwd=self.workdir,
        )

    def register(self, names: list[str]) -> dict[str, int]:
        """Register the public keys of SuperNodes ``names`` with the SuperLink (``flwr
        supernode register``, ``REGISTER_BATCH`` at a time); returns name -> node id (also kept
        in :attr:`node_ids`)."""
        if self.tls is None:
            raise RuntimeError("an insecure deployment has no SuperNode authentication")
        todo = [n for n in dict.fromkeys(names) if n not in self.node_ids]
        failed: list[str] = []
        for first in range(0, len(todo), REGISTER_BATCH):
            batch = {
                name: self._start_register(name) for name in todo[first : first + REGISTER_BATCH]
            }
            for name, proc in batch.items():
                try:
                    out, err = proc.communicate(timeout=self.register_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
                text = out.decode(errors="replace")
                log = self.workdir / f"register-{name}.log"
                log.write_text(text + err.decode(errors="replace"))
                reply = _registered_id(text)
                if isinstance(reply, int) and proc.returncode == 0:
                    self.node_ids[name] = reply
                else:
                    failed.append(f"{name} ({reply}, exit {proc.returncode})")
        if failed:
            raise RuntimeError(
                f"flwr supernode register failed for {', '.join(failed)}; logs: "
                f"{self.workdir}/register-*.log"
            )
        return {name: self.node_ids[name] for name in names}

    def online_node_ids(self) -> set[int]:
        """Ids of the SuperNodes the SuperLink lists as online (``flwr supernode ls``)."""
        out = subprocess.run(
            [self._exe("flwr"), "supernode", "ls", CONNECTION, "--format", "json"],
            capture_output=True,
            env=self.env(),
            cwd=self.workdir,
            timeout=self.register_timeout,
        ).stdout.decode(errors="replace")
        try:
            nodes = json.loads(out[out.find("{") :])["nodes"]
            return {int(n["node-id"]) for n in nodes if n.get("status") == "online"}
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"flwr supernode ls gave no node list: {out[-300:]!r}") from None

    def start_node(
        self, name: str, partition: int, *, register: bool = True, **node_config: str
    ) -> None:
        """Start one SuperNode claiming ``partition`` (``node_config``: further entries, e.g.
        ``state-dir``); a name already used gets a fresh log and keeps its key (a restart).

        Authenticated deployments: the node signs with ``name``'s key, registered first unless
        ``register=False`` (a node the SuperLink must refuse).  A name registered after
        :meth:`start` is authenticated but bound to no partition.
        """
        auth: list[str] = []
        if self.tls is not None:
            if register:
                self.register([name])
            auth = ["--auth-supernode-private-key", str(self.node_key(name).private_key)]
        extra = "".join(f' {k}="{v}"' for k, v in {**self.node_config, **node_config}.items())
        self._spawn(
            name,
            [
                "flower-supernode",
                *self._transport_args(server=False),
                *auth,
                "--superlink",
                f"{HOST}:{self.port}",
                "--host",
                HOST,
                "--port",
                str(free_port()),
                "--node-config",
                f"partition-id={partition} num-partitions={self.num_nodes}{extra}",
            ],
        )

    def start_run(self, app_dir: Path, *, run_config: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``flwr run APP protofl-loopback --stream`` (its output goes to flwr-run.log),
        with :attr:`partition_map` in the run config; the process is stopped with the others."""
        from protofl.engine.flower.server_app import format_partition_map

        cmd = ["flwr", "run", str(app_dir), CONNECTION, "--stream"]
        if self.partition_map:
            cmd += ["--run-config", f'partition-map="{format_partition_map(self.partition_map)}"']
        if run_config:
            cmd += ["--run-config", run_config]
        return self._spawn("flwr-run", cmd)

    def flwr_run(
        self, app_dir: Path, *, run_config: str | None = None, timeout: float = 900.0
    ) -> int:
        """Run the app and wait until its log stream ends; returns flwr's exit code."""
        proc = self.start_run(app_dir, run_config=run_config)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._stop(proc)
            raise TimeoutError(f"flwr run did not finish within {timeout:.0f}s") from None

    def stop_node(self, index: int) -> None:
        """Stop SuperNode ``index`` (a node that disappears)."""
        name = f"supernode-{index}"
        last = len(self.names) - 1 - self.names[::-1].index(name)  # the latest start of it
        self._stop(self.procs[last])

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and group_alive(proc.pid):
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        if group_alive(proc.pid):
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.grace_s)

    def stop(self) -> list[int]:
        """Stop every started process group (SuperNodes first); returns pids still alive."""
        for proc in reversed(self.procs):
            self._stop(proc)
        return [pid for proc in self.procs for pid in group_alive(proc.pid)]

    def __enter__(self) -> LoopbackDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def logs(self) -> str:
        """The tail of every process log (for error messages)."""
        out = []
        for name in self.names:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
            out.append(f"--- {name} ---\n{text[-3000:]}")
        return "\n".join(out)


def run_loopback(
    config: ExperimentConfig,
    workdir: str | Path,
    *,
    num_nodes: int | None = None,
    round_timeout: float = 120.0,
    timeout: float = 900.0,
    insecure: bool = False,
) -> dict[str, Any]:
    """Write the app, deploy on loopback (authenticated unless ``insecure``), ``flwr run`` it,
    stop everything; the run summary."""
    from protofl.engine.flower.app import write_flower_app

    workdir = Path(workdir).absolute()
    runs = workdir / "runs"
    if num_nodes is None:
        from protofl.data.cache import protofl_home
        from protofl.engine.federated_data import build_federated_data

        num_nodes = len(build_federated_data(config, protofl_home()).clients)
    app = write_flower_app(
        workdir / "app",
        config,
        out_dir=runs,
        round_timeout=round_timeout,
        wait_timeout=min(timeout, 300.0),
        num_supernodes=num_nodes,
    )
    with LoopbackDeployment(workdir, num_nodes, insecure=insecure) as dep:
        code = dep.flwr_run(app, timeout=timeout)
        summaries = sorted(runs.glob("*/summary.json")) if runs.exists() else []
        if code != 0 or not summaries:
            raise RuntimeError(f"flwr run failed (exit {code}):\n{dep.logs()}")
    summary: dict[str, Any] = json.loads(summaries[-1].read_text())
    return summary


def main(argv: list[str] | None = None) -> int:
    """Command line: deploy one experiment on loopback and print its summary as JSON."""
    p = argparse.ArgumentParser(prog="python -m protofl.engine.flower.deploy", description=__doc__)
    p.add_argument("config", nargs="?", help="experiment YAML (default: the embedded default)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--workdir", default="flower-loopback", help="logs, app and run folder")
    p.add_argument("--nodes", type=int, default=None, help="SuperNodes (default: one per client)")
    p.add_argument("--round-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=900.0, help="limit for the whole run")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS and no SuperNode authentication (any local process may join)",
    )
    args = p.parse_args(argv)
    config = ExperimentConfig.from_yaml(args.config) if args.config else ExperimentConfig()
    config = config.with_overrides(args.set or [])
    summary = run_loopback(
        config,
        args.workdir,
        num_nodes=args.nodes,
        round_timeout=args.round_timeout,
        timeout=args.timeout,
        insecure=args.insecure,
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
