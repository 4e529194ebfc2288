"""Read the PromQL queries out of the checked-in Grafana dashboard (deploy/grafana/dashboards/minite.json).

Used by the tests: the static test checks the queries' metric names, and an end-to-end test runs every query
against a Prometheus that scraped the live services.

    from deploy.grafana.panels import panel_queries
    for title, expr in panel_queries(rate_interval="15s"):
        ...  # one (panel title, expr) per target; a panel with several targets gives several pairs

The dashboard's template variables `$job` and `$instance` are replaced by regexes as Grafana does it (a
selection of several values becomes `(a|b)`: `grafana_regex` writes one); by default `.+`, any value.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "minite.json"

# Grafana's built-in variable the dashboard's queries use, in both of Grafana's spellings.
RATE_INTERVAL_VARS = ("${__rate_interval}", "$__rate_interval")
# The dashboard's own template variables (templating.list, besides the DS_PROMETHEUS datasource variable).
TEMPLATE_VARS = ("job", "instance")
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$")


def grafana_regex(values) -> str:
    """A multi-value variable's value in a `=~` matcher, as Grafana's Prometheus datasource writes it: each
    value regex-escaped, `(a|b)` for several, then escaped for the PromQL string ("..."): backslashes doubled."""
    regexes = ["".join("\\" + c if c in _REGEX_SPECIAL else c for c in v) for v in values]
    if not regexes:
        raise ValueError("a variable needs at least one value")
    regex = regexes[0] if len(regexes) == 1 else "(" + "|".join(regexes) + ")"
    return regex.replace("\\", "\\\\").replace('"', '\\"')


def iter_panels(dashboard: dict):
    """Every panel of a dashboard model, including those nested in (collapsed) rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(path: str | os.PathLike = DASHBOARD, rate_interval: str = "15s",
                  variables: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every query target of the dashboard at `path`, in panel order.

    `$__rate_interval` (or `${__rate_interval}`) is replaced by `rate_interval`, a Prometheus duration such as
    "15s" or "1m"; `$job` and `$instance` (or `${job}`, `${instance}`) by `variables[name]`, a regex (default
    `.+`). Row panels (no targets) and targets with an empty expr give nothing. A query that uses any other
    variable is a ValueError.
    """
    if not _DURATION.match(rate_interval):
        raise ValueError(f"rate_interval must be a Prometheus duration such as '15s', got {rate_interval!r}")
    values = {name: ".+" for name in TEMPLATE_VARS}
    unknown = set(variables or {}) - set(TEMPLATE_VARS)
    if unknown:
        raise ValueError(f"the dashboard has no variable {sorted(unknown)[0]!r} (it has {', '.join(TEMPLATE_VARS)})")
    values.update(variables or {})
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
            for name, value in values.items():
                expr = re.sub(r"\$(\{%s\}|%s\b)" % (name, name), lambda _: value, expr)
            if "$" in expr:
                raise ValueError(f"{panel.get('title', '')}: {expr} uses a variable other than $__rate_interval, "
                                 f"{', '.join('$' + n for n in TEMPLATE_VARS)}")
            out.append((panel.get("title", ""), expr))
    return out
