"""Real object-storage servers on localhost for the remote-data tests.

- `S3Server`: moto's S3 server (``moto[server]``, the server s3fs's own tests run against), serving
  in a thread of the test process on a free port of 127.0.0.1, so its data survives `stop()`/`start()`.
- `RangeHTTPServer`: a plain HTTP/1.1 file server with HEAD, ETag and ``Range`` requests (206), and an
  index page for a folder (as ``python -m http.server`` serves, a 301 to the folder's URL with its slash
  first); over TLS with a certificate of `self_signed_certificate` when asked, refusing (403) the objects
  in ``deny``, and ignoring ``Range`` (200 and the whole file, as ``python -m http.server`` does) when
  ``ranges`` is False.

Both count, per object, the requests and the body bytes they served (objects only: not bucket listings
nor folder index pages), so a test can tell how many times a shard was downloaded by looking at the
server, not at the client; `RangeHTTPServer.redirects` lists the folders it redirected. `stop()` closes
the listening socket and every open connection (clients see "connection refused" until `start()`), and
`stall` makes the next GETs of an object hang for a while (a slow server).
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import socket
import ssl
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Counts:
    """Requests and body bytes served per object, and stalls to inject (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gets: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.stall: dict[str, tuple[float, int]] = {}  # object -> (seconds, how many GETs more)
        self.released = threading.Event()
        self.redirects: list[str] = []  # the paths answered with a redirect (a folder named without its slash)

    def reset(self) -> None:
        with self.lock:
            self.gets.clear()
            self.bytes.clear()
            self.redirects.clear()

    def served(self, key: str, n: int) -> None:
        with self.lock:
            self.bytes[key] += n

    def hold(self, key: str) -> bool:
        """Count a GET of ``key`` and stall it if asked to; True: `unstall` cut the stall short, and the
        request is dropped unanswered (503) instead of served late."""
        with self.lock:
            self.gets[key] += 1
            seconds, times = self.stall.get(key, (0.0, 0))
            if times <= 0:
                return False
            self.stall[key] = (seconds, times - 1)
            released = self.released
        return released.wait(seconds)

    def unstall(self) -> None:
        """End every stall now (stalled requests get a 503) and forget the ones asked for."""
        with self.lock:
            self.stall.clear()
            self.released.set()
            self.released = threading.Event()


class _Server:
    """A server in a thread that can be stopped (connections refused) and started again on its port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.counts = _Counts()
        self._server = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def _make(self):  # pragma: no cover - each server makes its own
        raise NotImplementedError

    def track(self, conn: socket.socket, opened: bool) -> None:
        with self._conns_lock:
            (self._conns.add if opened else self._conns.discard)(conn)

    def start(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                self._server = self._make()
                break
            except OSError:  # the port of a stopped server can linger a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse connections until `start()`: the listening socket and every open connection are closed."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._conns_lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
            self._conns.clear()
        self._thread.join(timeout=10)
        self._server = None

    @property
    def gets(self) -> dict[str, int]:
        return dict(self.counts.gets)

    @property
    def bytes_served(self) -> dict[str, int]:
        return dict(self.counts.bytes)

    def stall(self, key: str, seconds: float, times: int = 1) -> None:
        """The next ``times`` GETs of ``key`` wait ``seconds`` before answering (a slow server)."""
        with self.counts.lock:
            self.counts.stall[key] = (seconds, times)

    def unstall(self) -> None:
        self.counts.unstall()


# ---------------------------------------------------------------------------------------------- S3 (moto)


class S3Server(_Server):
    """moto's S3 API on ``self.endpoint``; ``self.client`` is a botocore client for setting up objects."""

    def __init__(self) -> None:
        super().__init__()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto accepts any; never a real one
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        os.environ.pop("AWS_PROFILE", None)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.start()
        from botocore.session import Session

        self.client = Session().create_client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def _make(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        owner, counts = self, self.counts

        class Handler(MotoRequestHandler):
            def setup(self) -> None:
                super().setup()
                owner.track(self.connection, True)

            def finish(self) -> None:
                owner.track(self.connection, False)
                super().finish()

            def log_request(self, *args, **kwargs) -> None:  # quiet
                pass

        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ, start_response) -> Iterable[bytes]:
            key = unquote(environ.get("PATH_INFO", "")).lstrip("/")
            if environ["REQUEST_METHOD"] != "GET" or "/" not in key:  # objects only, not bucket listings
                return app(environ, start_response)
            if counts.hold(key):
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            return _count_body(app(environ, start_response), key, counts)

        return make_server("127.0.0.1", self.port, counting, threaded=True, request_handler=Handler)

    def check_credentials(self, on: bool) -> None:
        """From now on moto checks each request's credentials (and IAM permissions), or accepts any."""
        import urllib.request

        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0" if on else b"inf",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request).read()

    def reset(self) -> None:
        """Every bucket and object gone (moto's own reset), counters at zero."""
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")).read()
        self.counts.reset()


def _count_body(body: Iterable[bytes], key: str, counts: _Counts) -> Iterable[bytes]:
    try:
        for chunk in body:
            counts.served(key, len(chunk))
            yield chunk
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


# ---------------------------------------------------------------------------------------------- HTTP


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files of a self-signed certificate for 127.0.0.1, valid for a day: a TLS
    server no client trusts unless told to (the ``cryptography`` package makes it)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


class RangeHTTPServer(_Server):
    """Serves the files under ``root`` at ``self.url``: HEAD, GET, ``Range: bytes=a-b`` (206), ETag; a
    folder as an HTML index page of one ``<a href="name">`` per entry (a folder's with its slash), and a
    folder named without its slash as a 301 to the URL with it, as ``python -m http.server`` does. With
    ``tls`` (certificate and key files) it speaks HTTPS; the objects named in ``deny`` get 403 Forbidden;
    with ``ranges`` False it ignores ``Range`` and answers 200 with the whole file (``python -m
    http.server``)."""

    def __init__(self, root: Path, tls: tuple[Path, Path] | None = None, *, ranges: bool = True) -> None:
        super().__init__()
        self.root = Path(root)
        self.tls = tls
        self.ranges = ranges
        self.deny: set[str] = set()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.start()

    @property
    def redirects(self) -> list[str]:
        """The paths answered with a 301 since the last reset (folders named without their slash)."""
        with self.counts.lock:
            return list(self.counts.redirects)

    def _make(self):
        owner, root, counts = self, self.root, self.counts

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def setup(self) -> None:
                super().setup()
                owner.track(self.connection, True)

            def finish(self) -> None:
                owner.track(self.connection, False)
                super().finish()

            def log_message(self, *args) -> None:  # quiet
                pass

            def _file(self) -> tuple[str, Path | None]:
                key = unquote(urlsplit(self.path).path).lstrip("/")
                p = root / key
                return key, (p if p.is_file() else None)

            def _folder(self, key: str, body: bool) -> bool:
                """Answer for the folder ``key`` (its index page, or a 301 to its URL with the slash);
                False when ``key`` names no folder."""
                p = root / key
                if not p.is_dir():
                    return False
                path = urlsplit(self.path).path
                if not path.endswith("/"):
                    with counts.lock:
                        counts.redirects.append(path)
                    self.send_response(301)
                    self.send_header("Location", f"{path}/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return True
                links = [
                    f'<a href="{html.escape(quote(e.name + "/" if e.is_dir() else e.name))}">{html.escape(e.name)}</a>'
                    for e in sorted(p.iterdir(), key=lambda e: e.name)
                ]
                page = ("<!DOCTYPE HTML>\n<html><body><ul>\n" + "".join(f"<li>{a}</li>\n" for a in links)).encode()
                page += b"</ul></body></html>\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                if body:
                    self.wfile.write(page)
                return True

            def _head(self, p: Path, status: int, length: int, extra: dict[str, str]) -> None:
                st = p.stat()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-tar")
                self.send_header("Content-Length", str(length))
                if owner.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()

            def _missing(self, status: int = 404) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self) -> None:
                key, p = self._file()
                if key in owner.deny:
                    return self._missing(403)
                if p is None:
                    if self._folder(key, body=False):
                        return None
                    return self._missing()
                self._head(p, 200, p.stat().st_size, {})

            def do_GET(self) -> None:
                key, p = self._file()
                if p is None and key not in owner.deny and self._folder(key, body=True):
                    return  # a listing, not an object: not counted
                if counts.hold(key):
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if key in owner.deny:
                    return self._missing(403)
                if p is None:
                    return self._missing()
                data = p.read_bytes()
                m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "") or "")
                if m is None or not owner.ranges:
                    self._head(p, 200, len(data), {})
                    body = data
                else:
                    start = int(m.group(1)) if m.group(1) else max(0, len(data) - int(m.group(2)))
                    end = min(int(m.group(2)) + 1, len(data)) if m.group(1) and m.group(2) else len(data)
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    body = data[start:end]
                    self._head(p, 206, len(body), {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"})
                self.wfile.write(body)
                counts.served(key, len(body))

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        if self.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self.tls)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        return server
