"""The floor under a daemon round trip: a bare asyncio Unix-socket server, no tierkv.

    python scripts/bench_rtt_floor.py --json

A blocking client (as ``tierkv.connect`` is) sends a request of ``--request-bytes`` and reads
a reply of ``--reply-bytes`` (defaults: the sizes of ``bench_daemon.py``'s acquire of a
4,096-token prompt, 16 KiB of token ids out and 256 keys and slots back), one at a time.
The server is asyncio in a child process, in two forms: ``streams`` (StreamReader, a task
per connection and ``readexactly`` under an ``asyncio.timeout`` per frame, as the daemon
reads) and ``protocol`` (``data_received`` callbacks, no task). It does nothing with a
request but answer it, so its CPU per round trip is what any asyncio daemon pays before
doing any work; compare it with the daemon's CPU per iteration in ``bench_daemon.py`` and
with the embedded call. Forms alternate, ``--runs`` each; medians reported.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import tempfile
import time
from pathlib import Path

HEAD = struct.Struct("<I")


def serve(path: str, form: str, reply_bytes: int) -> None:
    reply = HEAD.pack(reply_bytes) + b"r" * reply_bytes

    async def main() -> None:
        if form == "streams":
            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                loop = asyncio.get_running_loop()
                while True:
                    try:
                        async with asyncio.timeout(300) as deadline:
                            first = await reader.readexactly(1)
                            deadline.reschedule(loop.time() + 30)
                            (n,) = HEAD.unpack(first + await reader.readexactly(HEAD.size - 1))
                            await reader.readexactly(n)
                    except asyncio.IncompleteReadError:
                        return
                    writer.write(reply)

            server = await asyncio.start_unix_server(handle, path)
        else:
            class Proto(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    self.transport, self.buf = transport, bytearray()

                def data_received(self, data: bytes) -> None:
                    self.buf += data
                    while len(self.buf) >= HEAD.size:
                        (n,) = HEAD.unpack_from(self.buf)
                        if len(self.buf) < HEAD.size + n:
                            break
                        del self.buf[: HEAD.size + n]
                        self.transport.write(reply)  # type: ignore[attr-defined]

            server = await asyncio.get_running_loop().create_unix_server(Proto, path)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def recv_exact(sock: socket.socket, n: int) -> None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("server closed")
        got += k


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure(form: str, args: argparse.Namespace, work: Path) -> dict:
    path = str(work / f"{form}.sock")
    pid = os.fork()
    if pid == 0:  # the server: nothing but asyncio and the socket
        try:
            serve(path, form, args.reply_bytes)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while True:  # the path exists from bind(), before listen(): retry until it accepts
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise SystemExit("server did not start") from None
                time.sleep(0.01)
        request = HEAD.pack(args.request_bytes) + b"q" * args.request_bytes

        def round_trip() -> None:
            sock.sendall(request)
            recv_exact(sock, HEAD.size + args.reply_bytes)

        for _ in range(args.iterations // 10):  # warm-up
            round_trip()
        c0, w0, p0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
        for _ in range(args.iterations):
            round_trip()
        wall, client = time.perf_counter() - w0, time.process_time() - p0
        server = cpu_seconds(pid) - c0
        sock.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    n = args.iterations
    return {"round_trip_us": 1e6 * wall / n, "server_cpu_us": 1e6 * server / n, "client_cpu_us": 1e6 * client / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--request-bytes", type=int, default=16 * 1024 + 120)
    ap.add_argument("--reply-bytes", type=int, default=256 * 36 + 80)
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"streams": [], "protocol": []}
    with tempfile.TemporaryDirectory(prefix="tkv-rtt-") as tmp:
        for _ in range(args.runs):
            for form in runs:
                runs[form].append(measure(form, args, Path(tmp)))
    out = {f"{form}_{k}": statistics.median(r[k] for r in rs) for form, rs in runs.items() for k in rs[0]}
    out["cpus"] = os.cpu_count()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v:.1f}")


if __name__ == "__main__":
    main()
