"""A TCP forwarder that delays every byte by a fixed time each way: a network
with real latency, for benchmarks that want more than loopback.

It runs its own event loop in a thread, so that its work does not share the
benchmark's loop. Bytes keep their order: each direction is one queue drained
by one task. asyncio's timers have a resolution of about a millisecond, so the
delay a direction really gets is rounded up towards that: report the round trip
measured through the proxy, not the delay asked for.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import threading


class DelayingProxy:
    def __init__(self, target_host: str, target_port: int, one_way_seconds: float) -> None:
        self.target = (target_host, target_port)
        self.delay = one_way_seconds
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        sock.close()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        ready.set()
        self._loop.run_forever()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()

        async def deliver() -> None:
            while True:
                while not queue:
                    arrived.clear()
                    await arrived.wait()
                due, data = queue.popleft()
                if data == b"":
                    writer.close()
                    return
                wait = due - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                queue.append((self._loop.time() + self.delay, data))
                arrived.set()
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            sender.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy is closing: end quietly
        finally:
            writer.close()
            up_writer.close()

    def dsn(self, dsn: str) -> str:
        """``dsn`` rewritten to go through the proxy."""
        host_port = dsn.split("@", 1)[1].split("/", 1)[0]
        return dsn.replace(host_port, f"127.0.0.1:{self.port}")

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(5)
