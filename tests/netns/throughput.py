"""TCP goodput probe, run inside test-bed hosts through `cluster exec`.

    python3 throughput.py server ADDR        prints "ready PORT", then "BYTES SECONDS" at EOF
    python3 throughput.py client ADDR PORT SECONDS

The receiver times from its first byte to EOF, so data still queued when the sender stops
(socket buffers, the tbf queue) is counted along with the time it takes to drain.
Every socket operation has a timeout: a probe never outlives a broken test.
"""
import socket
import sys
import time

TIMEOUT = 30.0
CHUNK = 1 << 20


def server(addr):
    with socket.create_server((addr, 0)) as lsock:
        lsock.settimeout(TIMEOUT)
        print("ready", lsock.getsockname()[1], flush=True)
        conn, _ = lsock.accept()
    with conn:
        conn.settimeout(TIMEOUT)
        buf = bytearray(CHUNK)
        total, t0 = 0, None
        while True:
            k = conn.recv_into(buf)
            if not k:
                break
            if t0 is None:
                t0 = time.perf_counter()
            total += k
        print(total, time.perf_counter() - t0 if t0 else 0.0, flush=True)


def client(addr, port, seconds):
    data = bytes(CHUNK)
    with socket.create_connection((addr, port), timeout=TIMEOUT) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(data)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2])
    else:
        client(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
