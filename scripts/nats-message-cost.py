#!/usr/bin/env python3
"""What one message costs a nats-server, by payload size, at a given spacing.

A local nats-server (on PATH) and three plain NATS connections, as three sync replicas: each
subscribes to one subject without echo, and they publish in turn, one message every GAP_MS, so
each message is read once by the server and written to the two others. The server's CPU (user
+ system, /proc/<pid>/stat, 10 ms ticks) over each size's messages, a message:

    scripts/nats-message-cost.py [--messages 500] [--gap-ms 38] [--sizes 0,8000,0,8000]

--gap-ms 38 is `kvroute bench sync --live`'s spacing (about 530 messages over its 20 s pass),
8,000 bytes about its bookings' size, 0 the message alone: the difference of the two is what
the bytes cost the server. Run with GOMAXPROCS set to see what the server's Go runtime costs.
One JSON line a size, in the order given.
"""

import argparse
import json
import os
import socket
import subprocess
import threading
import time


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port):
    deadline = time.time() + 10
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.recv(4096)  # INFO
    s.sendall(b'CONNECT {"echo":false,"verbose":false,"pedantic":false}\r\nSUB ev 1\r\nPING\r\n')
    seen = b""
    while b"PONG" not in seen:
        seen += s.recv(4096)
    return s


def drain(s):
    while True:
        data = s.recv(1 << 16)
        if not data:
            return
        if b"PING\r\n" in data:
            s.sendall(b"PONG\r\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--gap-ms", type=float, default=38.0)
    parser.add_argument("--sizes", default="0,8000,0,8000")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        ["nats-server", "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        conns = [connect(port) for _ in range(3)]
        for c in conns:
            threading.Thread(target=drain, args=(c,), daemon=True).start()
        for size in (int(x) for x in args.sizes.split(",")):
            payload = b"x" * size
            before, start = cpu_seconds(server.pid), time.time()
            for i in range(args.messages):
                conns[i % 3].sendall(b"PUB ev %d\r\n" % size + payload + b"\r\n")
                time.sleep(args.gap_ms / 1e3)
            time.sleep(0.3)
            spent = cpu_seconds(server.pid) - before
            print(json.dumps({
                "payload_bytes": size,
                "messages": args.messages,
                "gap_ms": args.gap_ms,
                "server_cpu_ms": round(spent * 1e3, 1),
                "server_us_per_message": round(spent / args.messages * 1e6, 1),
                "wall_s": round(time.time() - start, 2),
            }), flush=True)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
