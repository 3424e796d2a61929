"""Bridge the host's loopback and the real nodes' network namespaces, without routing.

The control plane and the S3 server listen on the host's 127.0.0.1 only; the real nodes
(kubelet, kube-proxy, containerd and their pods) live in network namespaces of their own.
Rather than giving the host namespace an address and routes into them (which would touch
the host's network), this one process holds sockets in several namespaces at once: a
socket belongs to the namespace its creator was in when it was created, so we `setns`
into a node's namespace, create a socket, and step back.

- `listen`: for each node, a listening socket in the node's namespace (the "host services"
  address) whose connections are spliced to a port on the host's 127.0.0.1: the API server
  for kubelets, kube-proxy and pods (through the `kubernetes` Service), and the S3 server.
- `proxy`: a Unix socket for the API server's egress selector (the konnectivity mechanism
  of Kubernetes): the API server sends `CONNECT <ip>:<port>` for its connections to
  kubelets and pods, and we connect from inside the namespace that owns that address.
- `cut`: a node whose namespace is listed in `cut.json` beside the config (read again on
  SIGUSR1) is partitioned from the host's services: its open connections are aborted, new
  ones closed at once, and the API server's connections to it refused (faults.py cuts its
  switch link too).

Run as `python hack/testenv/forward.py CONFIG.json`; stops on SIGTERM. Single-threaded
asyncio, so switching namespaces around a `socket()` call cannot race with anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
CONNECT_TIMEOUT_S = 10.0
HEADER_LIMIT = 8192
CUT_FILE = "cut.json"  # beside the config: the node namespaces cut off (faults.py writes it)
_libc = ctypes.CDLL(None, use_errno=True)
_HOST_NS = os.open("/proc/self/ns/net", os.O_RDONLY)


@contextlib.contextmanager
def netns(path: str | None) -> Iterator[None]:
    """Run the body in the network namespace at `path` (None: stay in the host's)."""
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
        yield
    finally:
        os.close(fd)
        if _libc.setns(_HOST_NS, CLONE_NEWNET) != 0:  # never stay in a node's namespace
            os._exit(3)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _splice(a: tuple, b: tuple, ns: str | None = None) -> None:
    """Pipe both ways until either side ends; while it lasts, the connection is listed
    under the node namespace `ns` so that cutting the node can abort it."""
    live = LIVE.setdefault(ns, set()) if ns else set()
    pair = (a[1], b[1])
    live.add(pair)
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        live.discard(pair)


# Node namespaces cut off from the host's services (partitioned), and the open connections
# of every node namespace, so that a cut can abort them.
CUT: set[str] = set()
LIVE: dict[str, set[tuple]] = {}


def apply_cut(path: str) -> None:
    """Read the list of cut namespaces from `path` (missing: none) and abort the open
    connections of each newly cut one, as a pulled cable would end them."""
    try:
        with open(path) as f:
            wanted = set(json.load(f))
    except (OSError, ValueError):
        wanted = set()
    for ns in wanted - CUT:
        for pair in list(LIVE.get(ns, ())):
            for writer in pair:
                writer.transport.abort()
    CUT.clear()
    CUT.update(wanted)


async def _open(ns: str | None, host: str, port: int) -> tuple:
    with netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), CONNECT_TIMEOUT_S)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def serve_listener(ns: str, addr: str, port: int, target_port: int) -> asyncio.AbstractServer:
    """Connections to addr:port inside `ns` go to 127.0.0.1:target_port on the host."""
    with netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
    sock.listen(128)
    sock.setblocking(False)

    async def handle(reader, writer):
        if ns in CUT:
            writer.transport.abort()
            return
        try:
            upstream = await _open(None, "127.0.0.1", target_port)
        except (TimeoutError, OSError):
            writer.close()
            return
        await _splice((reader, writer), upstream, ns)

    return await asyncio.start_server(handle, sock=sock)


def owner(routes: list[tuple[ipaddress.IPv4Network, str]], host: str) -> str | None:
    """The namespace whose networks contain `host` (a node IP or a pod IP)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return next((ns for net, ns in routes if ip in net), None)


async def serve_proxy(path: str, routes: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]]
                      ) -> asyncio.AbstractServer:
    """HTTP CONNECT over a Unix socket, for the API server's egress selector."""

    async def handle(reader, writer):
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT_S)
            method, target, _ = head.split(b"\r\n", 1)[0].decode("ascii").split(" ", 2)
            host, _, port = target.rpartition(":")
            ns = owner(routes, host)
            if method != "CONNECT" or ns is None or not port.isdigit():
                raise ValueError(f"refused {method} {target}")
            if ns in CUT:
                raise ValueError(f"{target} is partitioned")
            upstream = await _open(ns, host, int(port))
        except (TimeoutError, ValueError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                UnicodeDecodeError) as e:
            with contextlib.suppress(Exception):
                writer.write(f"HTTP/1.1 502 Bad Gateway\r\n\r\n{e}\r\n".encode())
                await writer.drain()
                writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await _splice((reader, writer), upstream, ns)

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = await asyncio.start_unix_server(handle, path=path, limit=HEADER_LIMIT)
    os.chmod(path, 0o600)
    return server


async def main(config: dict, cut_file: str) -> None:
    apply_cut(cut_file)
    routes = [(ipaddress.ip_network(net), n["netns"]) for n in config["nodes"] for net in n["networks"]]
    servers = [await serve_proxy(config["proxy_socket"], routes)]
    for node in config["nodes"]:
        for fwd in config["listen"]:
            servers.append(await serve_listener(node["netns"], config["services_ip"], fwd["port"], fwd["target_port"]))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, apply_cut, cut_file)
    print("forwarder ready", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        config = json.load(f)
    asyncio.run(main(config, os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), CUT_FILE)))
