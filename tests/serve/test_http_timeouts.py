"""HTTP read deadlines (issue 17, defect 9) on a real rollout process with short limits (`--http-header-timeout
1 --http-body-timeout 1 --http-keep-alive 1`): a connection that sends nothing, a slowloris client that
trickles its request head a byte at a time, a request whose Content-Length lies (the body never comes) and
an idle keep-alive connection are all closed by the server; a normal request, and a slow but steady upload,
are served. Each scenario prints one "RELIABILITY: ..." line (`pytest -s`)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.service_helpers import free_port, report

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1.0


@pytest.fixture(scope="module")
def url(service_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("http") / "rollout.log"
    g, h = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "MINITE_AUTH_TOKEN"}
    p = subprocess.Popen([sys.executable, "-m", "minite_core.cli", "rollout", "--model-dir", str(service_model),
                          "--grpc-port", str(g), "--http-port", str(h), "--http-header-timeout", str(LIMIT),
                          "--http-body-timeout", str(LIMIT), "--http-keep-alive", str(LIMIT)],
                         stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    t0 = time.monotonic()
    while "ready" not in log.read_text():
        assert p.poll() is None and time.monotonic() - t0 < 60, log.read_text()[-2000:]
        time.sleep(0.1)
    yield f"http://127.0.0.1:{h}", h
    p.kill()
    p.wait()


def _closed_after(sock: socket.socket, limit: float, trickle: bytes = b"", every: float = 0.2) -> float | None:
    """Seconds until the server closes `sock` (recv returns b"" or the connection resets), sending one byte
    of `trickle` every `every` s meanwhile; None if it is still open after `limit` s."""
    t0 = time.monotonic()
    sock.settimeout(every)
    i = 0
    while time.monotonic() - t0 < limit:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if i < len(trickle):
            try:
                sock.sendall(trickle[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
            i += 1
    return None


def test_a_silent_connection_is_closed(url):
    with socket.create_connection(("127.0.0.1", url[1])) as s:
        took = _closed_after(s, 10 * LIMIT)
    assert took is not None and took < 3 * LIMIT, took
    report("http_silent_connection", limit_s=LIMIT, closed_after_s=f"{took:.2f}")


def test_a_slowloris_head_is_closed_at_its_deadline(url):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", url[1])) as s:
        took = _closed_after(s, 10 * LIMIT, trickle=head, every=0.2)  # a byte every 0.2 s: never idle for 1 s
    assert took is not None and took < 3 * LIMIT, took
    report("http_slowloris", limit_s=LIMIT, byte_every_s=0.2, closed_after_s=f"{took:.2f}")


def test_a_lying_content_length_is_closed(url):
    with socket.create_connection(("127.0.0.1", url[1])) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": [1, 4]")
        took = _closed_after(s, 10 * LIMIT)
    assert took is not None and took < 3 * LIMIT, took
    report("http_lying_content_length", limit_s=LIMIT, closed_after_s=f"{took:.2f}")


def test_an_idle_keep_alive_connection_is_closed(url):
    with socket.create_connection(("127.0.0.1", url[1])) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        took = _closed_after(s, 10 * LIMIT)
    assert took is not None and took < 3 * LIMIT, took


def test_normal_and_slow_but_steady_requests_are_served(url):
    r = httpx.post(f"{url[0]}/v1/completions", json={"prompt": [1, 4, 13, 5, 14], "max_tokens": 2,
                                                     "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    body = b'{"prompt": [1, 4, 13, 5, 14], "max_tokens": 2, "ignore_eos": true}'
    with socket.create_connection(("127.0.0.1", url[1])) as s:  # the body over 2.5 s, a piece every 0.5 s
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), len(body) // 5 + 1):
            time.sleep(0.5)
            s.sendall(body[i:i + len(body) // 5 + 1])
        s.settimeout(30)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
