"""Prometheus /metrics over HTTP (prometheus-client's own server, on its own port)."""
from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger("dflash.metrics")


def start_metrics(port: int, host: str = "127.0.0.1") -> None:
    if port:
        start_http_server(port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, port)
