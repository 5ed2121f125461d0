"""A real S3 API on 127.0.0.1 for the tests (moto's server mode), and a fault-injecting HTTP proxy.

The proxy sits between s3fs and moto: every request is read whole, then answered by a rule
(an HTTP 500, a connection cut halfway through the body, a hold until released) or forwarded to
moto unchanged. Rules match on the method and the query (``uploadId``/``partNumber`` tell parts).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Match = Callable[[str, str], bool]  # (method, path with query) -> applies


@contextlib.contextmanager
def moto_server() -> Iterator[int]:
    """moto's S3 server on 127.0.0.1 (a thread of this process; subprocesses reach it too): its port."""
    import moto.server

    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield server.get_host_and_port()[1]
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict:
    """s3fs storage options for the test server: dummy keys, one attempt per request inside
    botocore/s3fs (lazyckpt's own retries are what is tested)."""
    return {
        "key": "testing", "secret": "testing", "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }  # fmt: skip


def is_part(method: str, path: str) -> bool:
    return method == "PUT" and "partNumber=" in path


def any_request(method: str, path: str) -> bool:
    return True


@dataclass
class Rule:
    action: str  # "fail" (HTTP status), "cut" (close mid-body), "hold" (wait for release)
    match: Match
    times: int  # how many matching requests it applies to
    status: int = 500
    released: threading.Event = field(default_factory=threading.Event)
    hits: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="test-fault-proxy", daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, action: str, match: Match = any_request, times: int = 1, status: int = 500) -> Rule:
        rule = Rule(action, match, times, status)
        with self.lock:
            self.rules.append(rule)
        return rule

    def close(self) -> None:
        with self.lock:
            for rule in self.rules:
                rule.released.set()
        self.server.shutdown()
        self.server.server_close()

    def _rule_for(self, method: str, path: str) -> Rule | None:
        with self.lock:
            self.seen.append((method, path))
            for rule in self.rules:
                if rule.hits < rule.times and rule.match(method, path):
                    rule.hits += 1
                    rule.arrived.set()
                    return rule
        return None

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        rule = self._rule_for(h.command, h.path)
        if rule is not None and rule.action == "cut":
            h.rfile.read(length // 2)
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        body = h.rfile.read(length) if length else b""
        if rule is not None and rule.action == "hold":
            rule.released.wait()
            h.close_connection = True
            return
        if rule is not None and rule.action == "fail":
            payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
            h.send_response(rule.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
        conn.request(h.command, h.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                h.send_header(k, v)
        h.send_header(
            "Content-Length", resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data))
        )
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
        conn.close()
