"""A TCP relay that can be cut: the network between one engine's event sockets and its readers.

The simulator can drop PUB messages (:mod:`loadtest.sim.faults`), but a dropped message
stays in the engine's replay buffer and the subscriber's idle probe fetches it over the
replay socket, which stays up: that is message loss, not a cut stream. A partition takes
both sockets away. The chaos suite points a router's ``kv_events`` and ``kv_replay`` for
one engine at two relays and :meth:`TcpRelay.cut` them: every open connection is reset
and new ones are refused until :meth:`TcpRelay.restore`, while the engine goes on serving
and publishing. ZMQ speaks plain TCP, so relaying bytes is transparent to it.
"""

from __future__ import annotations

import asyncio
import threading

from loadtest.fleet import free_port_run


class TcpRelay:
    """``127.0.0.1:port`` -> ``127.0.0.1:target_port``, served from a thread of its own."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port_run(1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{self.port}", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread.start()
        self._call(self._listen())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()

    def cut(self) -> None:
        """Reset every connection and refuse new ones."""
        self._call(self._cut())

    def restore(self) -> None:
        """Accept connections again (readers reconnect on their own)."""
        self._call(self._listen())

    def close(self) -> None:
        self._call(self._cut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
