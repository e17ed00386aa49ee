"""Read a service's Prometheus /metrics over HTTP."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(port: int, name: str, **labels: str) -> float | None:
    """The one sample of `name` whose labels include `labels`; None when absent."""
    hits = [v for lb, v in scrape(port).get(name, []) if labels.items() <= lb.items()]
    assert len(hits) <= 1, f"{name} {labels}: {len(hits)} samples match"
    return hits[0] if hits else None
