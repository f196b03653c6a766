"""Packing an envelope inside a running service (issue 36): `msgpack.packb` per frame against `bus.envelope.encode`.

    python -m bench.encoder [--calls 20000] [--rounds 5]

The old encode packed each frame with `msgpack.packb`, which allocates a 256 KiB buffer per call; the new one packs
with a reused per-thread `msgpack.Packer` of 4 KiB. Both encode the same two envelopes: a rendezvous join answer
(8 ranks) and a heartbeat. They are timed twice, in one run:

  plain    in this interpreter before any service exists: glibc's mmap threshold left dynamic, no zmq context
  service  in a handler of a running `bus.service.Service` (started in a thread here: its __init__ fixes the mmap
           threshold at 128 KiB and its zmq context runs its I/O thread), while a pinger thread keeps sending it
           pings (up to 5,000 a second, 64 unanswered at most) over a DEALER: the environment every service runs in

Each measurement alternates old and new in batches of `calls / 20` and takes the median µs per envelope over the
batches; in the service, `--rounds` requests each time `calls` envelopes per way, the medians of the rounds' medians
are printed. Last line: `ENCODER old_us=... new_us=... ratio=...` (the join answer, in the service; ratio = old/new).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from elastic_control_plane.bus.client import Client
from elastic_control_plane.bus.envelope import VERSION, Message, encode
from elastic_control_plane.bus.service import Request, Service, handles
from elastic_control_plane.bus.sockets import client_socket

BATCHES = 20
PING_PAUSE_S = 0.0002  # the pinger's pause between pings: busy, without holding the GIL most of the time
PINGS_IN_FLIGHT = 64  # unanswered pings at most: while the service times, its answers wait, none is dropped

ENVELOPES = {
    "join_answer": Message(
        type="join",
        body={
            "round": 3,
            "prefix": "round/3/",
            "hosts_timestamp": 1.0,
            "answers": [
                [
                    i,
                    {
                        "rank": i,
                        "local_rank": i,
                        "size": 32768,
                        "local_size": 8,
                        "cross_rank": 4095,
                        "cross_size": 4096,
                        "host": "host-4095",
                        "store_prefix": "round/3/",
                    },
                ]
                for i in range(8)
            ],
        },
        id="1234",
        round=3,
        sender="rendezvous",
        reply=True,
    ),
    "heartbeat": Message(
        type="heartbeat",
        body={"host": "host-4095", "incarnation": "agent:host-4095:12345:0123abcd", "warm": True},
        id="98765",
        sender="agent:host-4095:12345:0123abcd",
    ),
}


def packb_encode(msg: Message) -> list[bytes]:
    """The encode this replaced: one `msgpack.packb` (a fresh 256 KiB buffer) per frame."""
    header = {"v": VERSION, "type": msg.type, "id": msg.id, "round": msg.round, "from": msg.sender, "reply": msg.reply}
    return [msgpack.packb(header, use_bin_type=True), msgpack.packb(msg.body, use_bin_type=True), *msg.raw]


WAYS: dict[str, Callable[[Message], list[bytes]]] = {"old": packb_encode, "new": encode}


def time_encoders(calls: int) -> dict[str, dict[str, float]]:
    """Median µs per envelope over BATCHES batches, old and new alternating: {envelope: {way: µs}}."""
    per_batch = max(1, calls // BATCHES)
    samples: dict[str, dict[str, list[float]]] = {name: {way: [] for way in WAYS} for name in ENVELOPES}
    for _ in range(BATCHES):
        for name, msg in ENVELOPES.items():
            for way, encode_with in WAYS.items():
                started = time.perf_counter()
                for _ in range(per_batch):
                    encode_with(msg)
                samples[name][way].append((time.perf_counter() - started) / per_batch * 1e6)
    return {name: {way: statistics.median(us) for way, us in ways.items()} for name, ways in samples.items()}


class EncoderBenchService(Service):
    """A service whose one handler times the encoders in its own loop."""

    name = "encoder-bench"

    @handles("time_encoders")
    def on_time_encoders(self, request: Request) -> dict[str, Any]:
        return {"us": time_encoders(int(request.body["calls"]))}


def ping_until(endpoint: str, ctx: zmq.Context, stop: threading.Event) -> None:
    """Keep the service's socket and zmq's I/O thread busy: up to PINGS_IN_FLIGHT pings unanswered at a time."""
    sock = client_socket(ctx, zmq.DEALER, endpoint)
    in_flight = 0
    try:
        for n in itertools.count():
            if stop.is_set():
                return
            if in_flight < PINGS_IN_FLIGHT:
                sock.send_multipart(encode(Message(type="ping", id=str(n), sender="encoder-bench-pinger")))
                in_flight += 1
            while sock.poll(0):
                sock.recv_multipart()
                in_flight -= 1
            time.sleep(PING_PAUSE_S)
    finally:
        sock.close(linger=0)


def time_in_service(calls: int, rounds: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="elastic-encoder-") as tmp:
        endpoint = f"ipc://{Path(tmp) / 'service.sock'}"
        service = EncoderBenchService(endpoint)
        loop = threading.Thread(target=service.run, name="service-loop")
        loop.start()
        stop = threading.Event()
        pinger = threading.Thread(target=ping_until, args=(endpoint, service.ctx, stop), name="pinger")
        pinger.start()
        client = Client(endpoint, "encoder-bench", timeout=120.0, ctx=service.ctx)
        try:
            results = [client.request("time_encoders", {"calls": calls}).body["us"] for _ in range(rounds)]
        finally:
            client.close()
            service.stop()  # before the pinger goes: the loop answers no ping to a closed socket
            loop.join()
            stop.set()
            pinger.join()
            service.close()
    return {name: {way: statistics.median(r[name][way] for r in results) for way in WAYS} for name in ENVELOPES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000, help="envelopes per way and measurement")
    parser.add_argument("--rounds", type=int, default=5, help="timing requests sent to the service")
    args = parser.parse_args()
    plain = time_encoders(args.calls)  # first: once a service exists, the process's mmap threshold stays fixed
    in_service = time_in_service(args.calls, args.rounds)
    print(f"{'environment':<12} {'envelope':<12} {'old µs':>8} {'new µs':>8} {'old/new':>8}")
    for environment, results in (("plain", plain), ("service", in_service)):
        for name, us in results.items():
            print(f"{environment:<12} {name:<12} {us['old']:>8.2f} {us['new']:>8.2f} {us['old'] / us['new']:>8.2f}")
    old, new = in_service["join_answer"]["old"], in_service["join_answer"]["new"]
    print(f"ENCODER old_us={old:.2f} new_us={new:.2f} ratio={old / new:.2f}")


if __name__ == "__main__":
    main()
