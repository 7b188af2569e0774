"""An emulator of the Azure Blob service calls adlfs makes for tfsn's az:// checkpoints, over HTTP.

Shapes follow https://learn.microsoft.com/rest/api/storageservices/blob-service-rest-api, path-style as Azurite
serves them (http://HOST/ACCOUNT/CONTAINER/BLOB): Get Container Properties, List Blobs (XML, flat or by a
delimiter), Put Blob, Put Block and Put Block List, Get Blob (whole or by x-ms-range), Get Blob Properties, Copy Blob
(x-ms-copy-source; done at once, as a copy within one account is), Delete Blob. The JSON base of the other emulators
(_http.py) does not fit: the Blob service speaks headers, raw bodies and XML. A client reaches it through a
connection string (`connection_string`) whose BlobEndpoint is this server; requests must carry a SharedKey
Authorization for the account, which is checked for its presence and account name, not its signature.
"""
from __future__ import annotations

import base64
import hashlib
import itertools
import threading
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from tests.emulators._http import Answer, handler_class

ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public): the SDK signs with it, the emulator does not check signatures.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
VERSION = "2025-11-05"


@dataclass
class Blob:
    data: bytes
    etag: str
    modified: float
    created: float


@dataclass
class Container:
    blobs: dict[str, Blob] = field(default_factory=dict)
    blocks: dict[tuple[str, str], bytes] = field(default_factory=dict)   # (blob, block id): staged, uncommitted


class BlobEmulator:
    """The Blob service of one account on 127.0.0.1; `containers` holds what it stores."""

    def __init__(self, containers: tuple[str, ...] = ()) -> None:
        self.containers = {name: Container() for name in containers}
        self._lock = threading.RLock()
        self._etags = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class(self._answer))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={self.url};"

    def __enter__(self) -> BlobEmulator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- the operations: each returns (status, headers, body) ----------------------------------------------

    def serve(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
              body: bytes) -> tuple[int, dict[str, str], bytes]:
        account, _, rest = path.lstrip("/").partition("/")
        if account != ACCOUNT or not headers.get("authorization", "").startswith(f"SharedKey {ACCOUNT}:"):
            return _error(403, "AuthenticationFailed", "no SharedKey authorization for this account")
        container_name, _, name = rest.partition("/")
        with self._lock:
            container = self.containers.get(unquote(container_name))
            if container is None:
                return _error(404, "ContainerNotFound", "The specified container does not exist.")
            if not name:
                return self._container(method, query, unquote(container_name), container)
            return self._blob(method, query, headers, body, container, unquote(name))

    def _container(self, method: str, query: dict[str, str], name: str,
                   container: Container) -> tuple[int, dict, bytes]:
        if method in ("GET", "HEAD") and query.get("restype") == "container" and "comp" not in query:
            return 200, {"ETag": '"0x1"', "Last-Modified": _date(0)}, b""
        if method == "GET" and query.get("comp") == "list":
            return 200, {"Content-Type": "application/xml"}, self._list(name, container, query)
        return _error(400, "UnsupportedHttpVerb", f"{method} on a container with {sorted(query)}")

    def _list(self, container_name: str, container: Container, query: dict[str, str]) -> bytes:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        items, prefixes = [], []
        for name in sorted(container.blobs):
            if not name.startswith(prefix):
                continue
            cut = name.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                sub = name[:cut + len(delimiter)]
                if sub not in prefixes:
                    prefixes.append(sub)
                    items.append(f"<BlobPrefix><Name>{escape(sub)}</Name></BlobPrefix>")
                continue
            blob = container.blobs[name]
            items.append(
                f"<Blob><Name>{escape(name)}</Name><Properties><Creation-Time>{_date(blob.created)}</Creation-Time>"
                f"<Last-Modified>{_date(blob.modified)}</Last-Modified><Etag>{blob.etag}</Etag>"
                f"<Content-Length>{len(blob.data)}</Content-Length><Content-Type>application/octet-stream"
                "</Content-Type><BlobType>BlockBlob</BlobType><AccessTier>Hot</AccessTier>"
                "<LeaseStatus>unlocked</LeaseStatus><LeaseState>available</LeaseState></Properties>"
                "<Metadata /></Blob>")
        return (f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="{self.url}/" '
                f'ContainerName="{escape(container_name)}">'
                f"<Prefix>{escape(prefix)}</Prefix><Delimiter>{escape(delimiter)}</Delimiter><Blobs>{''.join(items)}"
                "</Blobs><NextMarker /></EnumerationResults>").encode()

    def _blob(self, method: str, query: dict[str, str], headers: dict[str, str], body: bytes, container: Container,
              name: str) -> tuple[int, dict, bytes]:
        comp = query.get("comp")
        if method == "PUT" and comp == "block":
            container.blocks[(name, query["blockid"])] = body
            return 201, {}, b""
        if method == "PUT" and comp == "blocklist":
            ids = [e.text or "" for e in ElementTree.fromstring(body)]
            missing = [i for i in ids if (name, i) not in container.blocks]
            if missing:
                return _error(400, "InvalidBlockList", f"no staged block {missing[0]}")
            return self._put(container, name, b"".join(container.blocks.pop((name, i)) for i in ids))
        if method == "PUT" and "x-ms-copy-source" in headers:
            source = unquote(urlsplit(headers["x-ms-copy-source"]).path).lstrip("/").split("/", 2)
            original = container.blobs.get(source[2]) if source[:2] == [ACCOUNT, source[1]] else None
            if original is None or self.containers.get(source[1]) is not container:
                return _error(404, "CannotVerifyCopySource", "The specified blob does not exist.")
            status, answer, _ = self._put(container, name, original.data)
            return 202, {**answer, "x-ms-copy-id": str(uuid.uuid4()), "x-ms-copy-status": "success"}, b""
        if method == "PUT" and comp is None:
            if headers.get("x-ms-blob-type") != "BlockBlob":
                return _error(400, "InvalidHeaderValue", "only block blobs")
            return self._put(container, name, body)
        blob = container.blobs.get(name)
        if blob is None:
            return _error(404, "BlobNotFound", "The specified blob does not exist.")
        if method == "DELETE":
            del container.blobs[name]
            return 202, {"x-ms-delete-type-permanent": "true"}, b""
        if method in ("GET", "HEAD") and comp is None:
            return self._read(method, headers, blob)
        return _error(400, "UnsupportedHttpVerb", f"{method} on a blob with {sorted(query)}")

    def _put(self, container: Container, name: str, data: bytes) -> tuple[int, dict, bytes]:
        now = float(next(self._etags))
        old = container.blobs.get(name)
        blob = Blob(data, f'"0x{int(now):X}"', now, old.created if old else now)
        container.blobs[name] = blob
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        return 201, {"ETag": blob.etag, "Last-Modified": _date(now), "Content-MD5": md5,
                     "x-ms-request-server-encrypted": "true"}, b""

    @staticmethod
    def _read(method: str, headers: dict[str, str], blob: Blob) -> tuple[int, dict, bytes]:
        answer = {"ETag": blob.etag, "Last-Modified": _date(blob.modified), "x-ms-creation-time": _date(blob.created),
                  "x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream",
                  "x-ms-lease-status": "unlocked", "x-ms-lease-state": "available", "Accept-Ranges": "bytes"}
        wanted = headers.get("x-ms-range") or headers.get("range")
        data, status = blob.data, 200
        if wanted:
            start, _, end = wanted.removeprefix("bytes=").partition("-")
            first, last = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
            if first >= len(data):
                return _error(416, "InvalidRange", "The range specified is invalid for the current size of the resource.",
                              {"Content-Range": f"bytes */{len(data)}"})
            data, status = data[first:last + 1], 206
            answer["Content-Range"] = f"bytes {first}-{last}/{len(blob.data)}"
        answer["Content-Length"] = str(len(data))
        return status, answer, b"" if method == "HEAD" else data

    def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Answer:
        parts = urlsplit(target)
        status, answer, payload = self.serve(method, parts.path, {k: v[-1] for k, v in parse_qs(parts.query).items()},
                                             headers, body)
        answer = {"x-ms-request-id": str(uuid.uuid4()), "x-ms-version": VERSION, "Date": _date(None), **answer}
        answer.setdefault("Content-Length", str(len(payload)))
        return status, list(answer.items()), payload


def _date(when: float | None) -> str:
    return formatdate(when, usegmt=True)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    body = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code><Message>{escape(message)}</Message>'
            "</Error>").encode()
    return status, {"x-ms-error-code": code, "Content-Type": "application/xml", **(headers or {})}, body
