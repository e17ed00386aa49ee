"""The Grafana dashboard of deploy/ as data: its panels, their PromQL, and the metric names each
query reads (for checking them against what the services export, and for rendering)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "dflash.json"
RATE_INTERVAL = "$__rate_interval"

# PromQL words that are not metric names (aggregators, functions are followed by "(")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
# a whole identifier (not the exponent of 1e3) that is not a function call
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*(?![A-Za-z0-9_:]|\s*\()")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    ref_id: str


@dataclass(frozen=True)
class Panel:
    id: int
    kind: str                        # timeseries | stat
    title: str
    description: str
    grid: tuple[int, int, int, int]  # x, y, w, h on Grafana's 24-column grid
    unit: str
    queries: tuple[Query, ...]
    mappings: dict[float, tuple[str, str]]     # value -> (text, color) of the value mappings
    stacked: bool                              # custom.stacking.mode == normal
    right_axis: frozenset[str]                 # refIds drawn on a right-hand axis


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def panels(dashboard: dict | None = None) -> list[Panel]:
    d = dashboard if dashboard is not None else load()
    out = []
    for p in d["panels"]:
        g = p["gridPos"]
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        out.append(Panel(p["id"], p["type"], p["title"], p.get("description", ""),
                         (g["x"], g["y"], g["w"], g["h"]), defaults.get("unit", ""),
                         tuple(Query(t["expr"], t.get("legendFormat", ""), t["refId"])
                               for t in p["targets"]),
                         _mappings(defaults), _stacked(defaults), _right_axis(p)))
    return out


def _mappings(defaults: dict) -> dict[float, tuple[str, str]]:
    out = {}
    for m in defaults.get("mappings", []):
        if m.get("type") == "value":
            for value, how in m["options"].items():
                out[float(value)] = (how.get("text", value), how.get("color", ""))
    return out


def _stacked(defaults: dict) -> bool:
    return defaults.get("custom", {}).get("stacking", {}).get("mode", "none") != "none"


def _right_axis(panel: dict) -> frozenset[str]:
    refs = set()
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        right = any(prop.get("id") == "custom.axisPlacement" and prop.get("value") == "right"
                    for prop in o.get("properties", []))
        if right and o.get("matcher", {}).get("id") == "byFrameRefID":
            refs.add(o["matcher"]["options"])
    return frozenset(refs)


def expressions(dashboard: dict | None = None) -> list[str]:
    return [q.expr for p in panels(dashboard) for q in p.queries]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers outside strings, label matchers, range
    brackets and grouping clauses that are not function calls or keywords."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {m.group(0) for m in _IDENT.finditer(text) if m.group(0).lower() not in _KEYWORDS}


def with_window(expr: str, window: str) -> str:
    """Grafana's $__rate_interval replaced by a fixed window (e.g. '30s')."""
    return expr.replace(RATE_INTERVAL, window)


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or \
        ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
