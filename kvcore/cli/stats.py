"""``kvcore stats SOURCE``: kvcore's figures, from a running engine or from a store.

``SOURCE`` is either the URL of a kvcore Prometheus endpoint (:func:`kvcore.metrics.
serve_prometheus`, or an engine's own ``/metrics`` with :class:`kvcore.metrics.
PrometheusCollector` registered), which is scraped once, or a backend's name, which is opened
(``--config``, ``--namespace``) for its own figures (what the store holds: objects, bytes,
capacity, evictions). Either way the figures are grouped: per operation (calls, blocks asked
and answered, failures), per tenant (lookups and reads asked and answered, hits as a share,
writes, refusals), and the gauges (the store's own, the read rate the facade measures).
``--json`` prints them as one object.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

from pydantic import ByteSize

from kvcore.cli.common import open_for_cli
from kvcore.cli.console import CommandConsole, Table, print_table
from kvcore.cli.errors import CliError, ExitCode
from kvcore.cli.options import add_config_option, load_config_arg
from kvcore.schemas import BackendContext

#: a scrape gives up after this long
SCRAPE_TIMEOUT_S = 10.0


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "source",
        metavar="SOURCE",
        help="a kvcore Prometheus endpoint to scrape (http://HOST:PORT/metrics), or a "
        "backend's name to open for its own figures",
    )
    add_config_option(sp, what="with a backend, its config")
    sp.add_argument(
        "--namespace",
        default="default",
        help="with a backend: the namespace to open (default: %(default)s)",
    )
    sp.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace, console: CommandConsole) -> int:
    if args.source.startswith(("http://", "https://")):
        figures = figures_of_scrape(scrape(args.source))
    else:
        backend = open_for_cli(
            args.source, load_config_arg(args.config), BackendContext(namespace=args.namespace)
        )
        try:
            figures = figures_of_stats(backend.stats())
        finally:
            backend.close()
    if args.json:
        console.out.print_json(json.dumps(figures))
    else:
        _print(figures, console)
    return ExitCode.OK


def scrape(url: str) -> str:
    """The exposition text at ``url`` (one line of error naming the URL otherwise)."""
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            body: bytes = response.read(64 << 20)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"cannot scrape {url!r}: {reason}", ExitCode.BACKEND_UNAVAILABLE) from None
    return body.decode("utf-8", "replace")


def _empty() -> dict[str, Any]:
    return {"ops": {}, "tenants": {}, "gauges": {}}


def figures_of_scrape(text: str) -> dict[str, Any]:
    """kvcore's samples of an exposition, grouped (:func:`_group`'s shape): counters
    ``<prefix>_<name>_total{op}`` per op, ``<prefix>_tenant_<name>_total{tenant,op}`` per
    tenant, gauges by name; labels other than ``op`` and ``tenant`` (a backend's name, a rank)
    become part of the group's name."""
    from prometheus_client.parser import text_string_to_metric_families

    out = _empty()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise CliError(f"not a Prometheus exposition: {exc}", ExitCode.FAILED) from None
    for family in families:
        if not family.name.startswith("kvcore_"):
            continue
        for sample in family.samples:
            labels = dict(sample.labels)
            op, tenant = labels.pop("op", None), labels.pop("tenant", None)
            where = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            name = sample.name
            if family.type == "counter":
                if not name.endswith("_total"):
                    continue  # the _created sample
                name = name.removesuffix("_total")
            elif family.type == "histogram" and not name.endswith(("_count", "_sum")):
                continue  # the buckets
            # kvcore_<component>_<name>: the transfer manager's or the backend facade's
            component, _, short = name.removeprefix("kvcore_").partition("_")
            if tenant is not None and short.startswith("tenant_"):
                # a backend's figure per tenant (tenant_gauges) has no op: the store's
                where_op = op if op is not None else STORE
                _add(out["tenants"], tenant, where_op, short.removeprefix("tenant_"), sample.value)
            elif op is not None:
                group = f"{component} {op}" + (f" ({where})" if where else "")
                out["ops"].setdefault(group, {})[short] = sample.value
            else:
                key = f"{component}_{short}" + (f"{{{where}}}" if where else "")
                out["gauges"][key] = sample.value
    return out


def figures_of_stats(stats: dict[str, float]) -> dict[str, Any]:
    """A backend's :meth:`kvcore.Backend.stats`, grouped as :func:`figures_of_scrape`
    groups a scrape."""
    out = _empty()
    for key, value in stats.items():
        name, _, rest = key.partition(".")
        if name.startswith("backend_tenant_") and rest:  # tenant_gauges: rest is the tenant
            _add(out["tenants"], rest, STORE, name.removeprefix("backend_tenant_"), value)
        elif name.startswith("tenant_") and rest.count(".") >= 1:
            op, tenant = rest.split(".", 1)
            _add(out["tenants"], tenant, op, name.removeprefix("tenant_"), value)
        elif rest:
            out["ops"].setdefault(rest, {})[name] = value
        else:
            out["gauges"][name] = value
    return out


#: the "operation" of a backend's figures per tenant (bytes held, reserved, evicted)
STORE = "store"


def _add(tenants: dict[str, Any], tenant: str, op: str, counter: str, value: float) -> None:
    tenants.setdefault(tenant, {}).setdefault(op, {})[counter] = value


def _print(figures: dict[str, Any], console: CommandConsole) -> None:
    if figures["ops"]:
        console.out.print("per operation:")
        table = Table(box=None)
        columns = ("calls", "blocks", "blocks_done", "errors", "deadline_missed")
        table.add_column("operation", justify="left")
        for col in columns:
            table.add_column(col, justify="right")
        for op, counts in sorted(figures["ops"].items()):
            table.add_row(op, *(_number(counts.get(col)) for col in columns))
        print_table(console.out, table)
    if figures["tenants"]:
        console.out.print("per tenant:")
        table = Table(box=None)
        for col in ("tenant", "lookups", "found", "reads", "read", "hit %", "writes",
                    "written", "refused", "failures", "held", "reserved", "evicted"):  # fmt: skip
            table.add_column(col, justify="left" if col == "tenant" else "right")
        for tenant, ops in sorted(figures["tenants"].items()):
            get: defaultdict[str, dict[str, float]] = defaultdict(dict, ops)
            asked = get["query"].get("blocks", 0.0)
            found = get["query"].get("blocks_done", 0.0)
            failures = sum(v.get("failures", 0.0) for v in ops.values())
            table.add_row(
                tenant,
                _number(asked),
                _number(found),
                _number(get["read"].get("blocks")),
                _number(get["read"].get("blocks_done")),
                f"{100 * found / asked:.1f}" if asked else "-",
                _number(get["write"].get("blocks")),
                _number(get["write"].get("blocks_done")),
                _number(get["write"].get("blocks_refused", get["admit"].get("blocks_refused"))),
                _number(failures),
                _bytes(get[STORE].get("bytes_held")),
                _bytes(get[STORE].get("bytes_reserved")),
                _bytes(get[STORE].get("bytes_evicted")),
            )
        print_table(console.out, table)
    if figures["gauges"]:
        console.out.print("gauges:")
        table = Table(box=None)
        table.add_column("name", justify="left")
        table.add_column("value", justify="right")
        for name, value in sorted(figures["gauges"].items()):
            table.add_row(name, _number(value))
        print_table(console.out, table)
    if not any(figures.values()):
        console.out.print("no kvcore figures found")


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{ByteSize(int(value)).human_readable(separator=' ')}"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"
