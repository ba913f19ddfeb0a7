"""A TCP forwarder on loopback that can go silent, to simulate a frozen network.

It runs its own event loop in a thread. ``freeze()`` stops passing bytes in both
directions without closing anything, as a dropped network or a paused host does.
It also counts round trips: each time a client speaks after the server has
answered it (or for the first time) is one. ``latency`` holds every chunk that
long before passing it on, each way: a slow network, which makes the moments
inside a round trip wide enough to land a cancellation in.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class FreezableProxy:
    def __init__(self, target_host: str, target_port: int, *, latency: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.latency = latency
        self.frozen = threading.Event()
        self.round_trips = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        sock.close()
        self._thread = threading.Thread(target=self._run, daemon=True)
        ready = threading.Event()
        self._ready = ready
        self._thread.start()
        ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_client: bool,
        turn: list[bool],
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                # turn[0]: the client spoke last on this connection.
                if from_client and not turn[0]:
                    self.round_trips += 1
                turn[0] = from_client
                while self.frozen.is_set():  # hold the bytes: the network is silent
                    await asyncio.sleep(0.05)
                if self.latency:
                    await asyncio.sleep(self.latency)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.frozen.is_set():
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        turn = [False]
        await asyncio.gather(self._pipe(reader, up_writer, True, turn),
                             self._pipe(up_reader, writer, False, turn))

    def dsn(self, dsn: str) -> str:
        """``dsn`` rewritten to go through the proxy."""
        host_port = dsn.split("@", 1)[1].split("/", 1)[0]
        return dsn.replace(host_port, f"127.0.0.1:{self.port}")

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.frozen.clear()

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(5)
