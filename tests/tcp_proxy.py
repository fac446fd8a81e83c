"""A real TCP proxy process for fault tests: it sits between a client and a server on 127.0.0.1
and either passes bytes through, stalls them, or cuts connections.

Modes (switched at run time with a line on the proxy's stdin; it answers ``mode MODE``):
- ``pass``: bytes flow both ways (bytes held by a stall are delivered first, in order);
- ``stall``: connections stay open but nothing is forwarded, new ones are accepted and stall too
  (a hung peer or a black-holed network: only the client's deadline ends the wait);
- ``cut``: every open connection is reset (RST, SO_LINGER 0) and new ones are reset on accept
  (a crashed peer or a dropped route: the client sees the failure at once).

    python -m tests.tcp_proxy --target 127.0.0.1:50051      # prints "listening PORT"
    ProxyProcess("127.0.0.1:50051").start().set_mode("stall")   # from a test
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import subprocess
import sys
from pathlib import Path

MODES = ("pass", "stall", "cut")
_CHUNK = 1 << 16


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.mode = "pass"
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._conns: set[asyncio.StreamWriter] = set()
        self.accepted = 0

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        if mode == "pass":
            self._flowing.set()
        else:
            self._flowing.clear()
        if mode == "cut":
            for w in list(self._conns):
                _reset(w)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode == "cut":
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _reset(writer)  # the server is down: the client sees what it would see without us
            return
        self._conns.update((writer, up_writer))
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._conns.discard(w)
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # a stall holds the bytes here (and TCP backpressure does the rest)
                if writer.is_closing():
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not writer.is_closing():
                writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with RST instead of FIN: the peer gets ECONNRESET, as when a host dies."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _main(target: str, port: int) -> None:
    host, _, tport = target.rpartition(":")
    proxy = Proxy(host, int(tport))
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = line.decode().strip()
        try:
            proxy.set_mode(cmd)
            print(f"mode {cmd}", flush=True)
        except ValueError as e:
            print(f"error {e}", flush=True)
    server.close()  # stdin closed: the test is done with us


class ProxyProcess:
    """The proxy as a child process, driven from a test or a bench script."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 30.0) -> "ProxyProcess":
        repo = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.tcp_proxy", "--target", self.target], cwd=repo,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self._line(timeout)
        if not line.startswith("listening "):
            raise RuntimeError(f"proxy did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_mode(self, mode: str, timeout: float = 30.0) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        line = self._line(timeout)
        if line != f"mode {mode}":
            raise RuntimeError(f"proxy refused mode {mode!r}: {line!r}")

    def _line(self, timeout: float) -> str:
        import select

        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("no answer from the proxy process")
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="HOST:PORT of the server behind the proxy")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0 = ephemeral, printed)")
    args = ap.parse_args()
    asyncio.run(_main(args.target, args.port))
