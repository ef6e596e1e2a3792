"""A JetStream cluster of real ``nats-server`` processes on this machine, for tests and benchmarks of what a
replicated deployment survives (a node killed under load). Production clusters come from NATS's own tooling (the
Helm chart); this only wires ``NatsServer`` processes together with routes::

    with NatsCluster(tmp, size=3) as cluster:
        cluster.url          # "nats://127.0.0.1:A,nats://127.0.0.1:B,nats://127.0.0.1:C" (SwitchyardConfig.nats_url)
        cluster.kill("n1")   # SIGKILL one node; restart(name) brings it back on the same store

Each node is named ``n0``, ``n1``, ...: the names JetStream reports as stream leaders and replicas.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

from switchyard.deploy.launcher import NatsServer, ServerStartError
from switchyard.deploy.processes import free_port


class NatsCluster:
    """``size`` clustered servers with JetStream, each with its store under ``root/<name>``."""

    def __init__(self, root: str | os.PathLike, size: int = 3, startup_timeout: float = 30.0) -> None:
        self.root = Path(root)
        route_ports = [free_port() for _ in range(size)]
        client_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
        self.nodes = {
            f"n{i}": NatsServer(self.root / f"n{i}", port=client_ports[i], startup_timeout=startup_timeout,
                                extra_args=["--name", f"n{i}", "--cluster_name", "switchyard",
                                            "--cluster", f"nats://127.0.0.1:{route_ports[i]}", "--routes", routes])
            for i in range(size)
        }
        self.url = ",".join(f"nats://127.0.0.1:{p}" for p in client_ports)

    def start(self) -> NatsCluster:
        """Start every node, then wait until each is healthy with the JetStream meta group formed."""
        try:
            for node in self.nodes.values():
                node.spawn()
            for node in self.nodes.values():
                node.wait_ready()
                self._wait_meta_current(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_meta_current(self, node: NatsServer) -> None:
        # /healthz without js-enabled-only answers 200 only once this node's JetStream is current with the meta
        # leader: before that, creating a stream fails with "JetStream system temporarily unavailable".
        deadline = time.monotonic() + node.startup_timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{node.monitor_url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise ServerStartError(f"nats-server {node.store_dir.name}: no JetStream meta leader after "
                               f"{node.startup_timeout:.0f} s")

    def kill(self, name: str) -> None:
        """SIGKILL one node (its store stays, for ``restart``)."""
        node = self.nodes[name]
        os.kill(node.pid, signal.SIGKILL)
        node.stop(timeout=5)

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        node.start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
