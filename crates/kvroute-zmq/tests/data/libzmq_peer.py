"""A libzmq peer (pyzmq) for tests/libzmq.rs: checks that the pure-Rust sockets interoperate
with the ZeroMQ library vLLM and SGLang use, frame for frame.

    libzmq_peer.py publish
        Binds a PUB and a ROUTER on free loopback ports, prints "PORTS <pub> <router>", then
        reads commands on stdin, one per line:
          PUB <hex payload>    numbers the batch (from 0), buffers it, sends [topic, seq, payload]
          DROP <hex payload>   numbers and buffers it without sending it
          QUIT
        and answers replay requests as vLLM's publisher does: a request must be
        [identity, b"", start (8 bytes big-endian)]; each buffered batch with seq >= start goes
        back as [identity, b"", topic, seq, payload], then [identity, b"", b"", END_SEQ, b""].

    libzmq_peer.py subscribe <pub endpoint> <replay endpoint>
        Connects a SUB (every topic) and a DEALER. Prints "LIVE <frames> <seq>" for the first
        live message, then asks for a replay from 0 and prints "REPLY <frames> <seq> <hex
        payload>" per reply until the end marker, then "END".
"""

import os
import sys

import zmq

TOPIC = b"kv@libzmq"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def publish():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    router = ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router_port = router.bind_to_random_port("tcp://127.0.0.1")
    print(f"PORTS {pub_port} {router_port}", flush=True)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    buffer = []
    seq = 0
    pending = b""
    while True:
        for sock, _ in poller.poll():
            if sock is router:
                frames = router.recv_multipart()
                if len(frames) != 3 or frames[1] != b"":
                    continue
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                for s, payload in buffer:
                    if s >= start:
                        router.send_multipart([identity, b"", TOPIC, s.to_bytes(8, "big"), payload])
                router.send_multipart([identity, b"", b"", END_SEQ, b""])
            else:
                # Raw reads: a buffered readline would keep further lines where poll cannot see them.
                chunk = os.read(sys.stdin.fileno(), 1 << 16)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip() == b"QUIT":
                        return
                    command, payload = line.split()
                    payload = bytes.fromhex(payload.decode())
                    buffer.append((seq, payload))
                    if command == b"PUB":
                        pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
                    seq += 1


def subscribe(pub_endpoint, replay_endpoint):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    frames = sub.recv_multipart()
    print(f"LIVE {len(frames)} {int.from_bytes(frames[1], 'big')}", flush=True)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    while True:
        frames = dealer.recv_multipart()
        seq = frames[-2]
        if seq == END_SEQ:
            print("END", flush=True)
            return
        print(f"REPLY {len(frames)} {int.from_bytes(seq, 'big')} {frames[-1].hex()}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "publish":
        publish()
    else:
        subscribe(sys.argv[2], sys.argv[3])
