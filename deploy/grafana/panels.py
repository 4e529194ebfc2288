"""Read the PromQL queries out of the checked-in Grafana dashboard (deploy/grafana/dashboards/minite.json).

Used by the tests: the static test checks the queries' metric names, and an end-to-end test runs every query
against a Prometheus that scraped the live services.

    from deploy.grafana.panels import panel_queries
    for title, expr in panel_queries(rate_interval="15s"):
        ...  # one (panel title, expr) per target; a panel with several targets gives several pairs
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "minite.json"

# The only Grafana variable the dashboard's queries may use, in both of Grafana's spellings.
RATE_INTERVAL_VARS = ("${__rate_interval}", "$__rate_interval")
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def iter_panels(dashboard: dict):
    """Every panel of a dashboard model, including those nested in (collapsed) rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(path: str | os.PathLike = DASHBOARD, rate_interval: str = "15s") -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every query target of the dashboard at `path`, in panel order.

    `$__rate_interval` (or `${__rate_interval}`) is replaced by `rate_interval`, a Prometheus duration such as
    "15s" or "1m". Row panels (no targets) and targets with an empty expr give nothing.
    """
    if not _DURATION.match(rate_interval):
        raise ValueError(f"rate_interval must be a Prometheus duration such as '15s', got {rate_interval!r}")
    with open(path, encoding="utf-8") as f:
        dashboard = json.load(f)
    out = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            expr = (target.get("expr") or "").strip()
            if not expr:
                continue
            for var in RATE_INTERVAL_VARS:
                expr = expr.replace(var, rate_interval)
            out.append((panel.get("title", ""), expr))
    return out
