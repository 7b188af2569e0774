"""A local AWS for tests: moto's server behind a small HTTP proxy that can answer some calls itself.

moto never runs out of capacity and has no Price List API, so the proxy answers chosen requests
with real-shaped AWS responses (EC2's XML errors, the pricing and SSM JSON documents) and
forwards every other request to moto unchanged. boto3 reaches it only through AWS_ENDPOINT_URL.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator
from urllib.parse import parse_qs


@dataclass
class Call:
    """One request as the proxy saw it."""

    method: str
    path: str
    target: str                 # X-Amz-Target (JSON protocols), "" for query protocols
    params: dict[str, str]      # the form parameters of a query-protocol call (EC2: Action=RunInstances, ...)
    body: bytes

    @property
    def action(self) -> str:
        return self.params.get("Action") or self.target.rsplit(".", 1)[-1]


@dataclass
class Rule:
    """Answer the calls that `match` accepts (at most `times` of them, None: all) with this response."""

    match: Callable[[Call], bool]
    status: int
    body: bytes
    content_type: str
    times: int | None = None
    hits: list[Call] = field(default_factory=list)


def ec2_error(code: str, message: str) -> bytes:
    """EC2's error document (query protocol)."""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error></Errors><RequestID>6f1e1c1a-test</RequestID></Response>").encode()


def price_list_item(instance_type: str, region: str, usd_per_hour: float) -> str:
    """One entry of the Price List API's GetProducts `PriceList`, shaped as AWS sends it (a JSON string)."""
    sku = f"SKU{zlib.crc32(f'{instance_type}/{region}'.encode()):010d}"
    return json.dumps({
        "product": {"productFamily": "Compute Instance", "sku": sku, "attributes": {
            "instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux", "tenancy": "Shared",
            "preInstalledSw": "NA", "capacitystatus": "Used", "licenseModel": "No License required"}},
        "serviceCode": "AmazonEC2",
        "terms": {"OnDemand": {f"{sku}.JRTCKXETXF": {
            "offerTermCode": "JRTCKXETXF", "sku": sku, "effectiveDate": "2026-11-01T00:00:00Z", "termAttributes": {},
            "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                "unit": "Hrs", "pricePerUnit": {"USD": f"{usd_per_hour:.10f}"}, "appliesTo": [],
                "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7", "beginRange": "0", "endRange": "Inf",
                "description": f"${usd_per_hour} per On Demand Linux {instance_type} Instance Hour"}}}}},
        "version": "20261101000000", "publicationDate": "2026-11-01T00:00:00Z"})


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of `upstream` (moto's URL) that applies `rules` first."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[Rule] = []
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:  # keep test output quiet
                pass

            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                form = parse_qs(body.decode("utf-8", "replace")) if "x-www-form-urlencoded" in (
                    self.headers.get("Content-Type") or "") else {}
                call = Call(self.command, self.path, self.headers.get("X-Amz-Target", ""),
                            {key: values[0] for key, values in form.items()}, body)
                rule = proxy._rule_for(call)
                if rule is not None:
                    return self._reply(rule.status, rule.content_type, rule.body)
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    reply = upstream.getresponse()
                    self._reply(reply.status, reply.getheader("Content-Type", ""), reply.read())
                finally:
                    upstream.close()

            def _reply(self, status: int, content_type: str, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _rule_for(self, call: Call) -> Rule | None:
        with self._lock:
            self.calls.append(call)
            for rule in self.rules:
                if rule.match(call) and (rule.times is None or len(rule.hits) < rule.times):
                    rule.hits.append(call)
                    return rule
        return None

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def fail_ec2(self, action: str, code: str, message: str, status: int = 500, times: int | None = None,
                 **params: str) -> Rule:
        """Answer the EC2 `action` calls whose form parameters include `params` with an EC2 error."""
        return self.add(Rule(lambda call: call.params.get("Action") == action and all(
            call.params.get(key) == value for key, value in params.items()),
            status, ec2_error(code, message), "text/xml", times))

    def answer_json(self, target: str, document: dict) -> Rule:
        """Answer the JSON-protocol calls with this X-Amz-Target (e.g. AWSPriceListService.GetProducts)."""
        return self.add(Rule(lambda call: call.target == target, 200, json.dumps(document).encode(),
                             "application/x-amz-json-1.1"))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forget_s3_clients() -> None:
    """Drop the S3 filesystems fsspec keeps per constructor arguments: each holds a client made with the endpoint
    of its day (AWS_ENDPOINT_URL_S3 is read once), so a later test's s3:// would reach an earlier, stopped moto
    server (connection refused; seen in whole-suite runs only, after tests/test_checkpoint_s3.py)."""
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return
    S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def moto_server() -> Iterator[int]:
    """A moto server on a free local port for the block's length, reached by fresh S3 clients; yields the port."""
    from moto.server import ThreadedMotoServer
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    forget_s3_clients()
    try:
        yield port
    finally:
        server.stop()
        forget_s3_clients()
