"""Measure TCP throughput between two emulated hosts: one side listens, the other sends.

    python benchmarks/cluster/linktest.py serve PORT               # prints the bytes it got
    python benchmarks/cluster/linktest.py send ADDR PORT SECONDS   # prints bytes and Mbit/s

The receiver counts bytes from the first byte to the last, so connection set-up and the slow
start of TCP fall outside the rate only as far as they fall outside that span. Run by
benchmarks.cluster's --linktest inside the hosts' network namespaces; standard library only.
"""

from __future__ import annotations

import json
import socket
import sys
import time

BLOCK = 1 << 20


def serve(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(1)
        print("listening", flush=True)
        connection, _ = listener.accept()
        with connection:
            buffer = bytearray(BLOCK)
            total, first, last = 0, None, None
            while True:
                got = connection.recv_into(buffer)
                if not got:
                    break
                last = time.perf_counter()
                if first is None:
                    first = last
                total += got
    seconds = (last - first) if total else 0.0
    print(json.dumps({"role": "receiver", "bytes": total, "seconds": seconds,
                      "mbit_per_s": total * 8 / seconds / 1e6 if seconds else 0.0}), flush=True)


def send(address: str, port: int, seconds: float) -> None:
    payload = b"\0" * BLOCK
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with connection:
        total, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            connection.sendall(payload)
            total += len(payload)
        connection.shutdown(socket.SHUT_WR)
        connection.recv(1)  # the receiver closes once it has read everything
        elapsed = time.perf_counter() - start
    print(json.dumps({"role": "sender", "bytes": total, "seconds": elapsed,
                      "mbit_per_s": total * 8 / elapsed / 1e6}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]))
    elif sys.argv[1:2] == ["send"]:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
