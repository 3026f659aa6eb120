"""``kvcore clear NAME``: delete a store's objects, an operator's way.

``--tenant T`` deletes every object tenant ``T`` stored (:mod:`kvcore.tenants`), of every
namespace and every process sharing the store, and nothing of another tenant's: the backend's
``kvcore_clear_tenant`` hook, which is crash-safe (a clear that a crash cut short is finished
by the next process to open the store; nothing of the tenant is served meanwhile). Without
it, every object of ``--namespace`` is deleted (``kvcore_clear``), every rank's.

One line on success (the objects removed); one line of error naming what failed otherwise,
with a non-zero exit: an unknown tenant, a backend that cannot clear a tenant, a removal that
failed (what was removed is said).

.. versionadded:: 0.3
"""

from __future__ import annotations

import argparse
import json

from kvcore.cli.common import open_for_cli
from kvcore.cli.console import CommandConsole
from kvcore.cli.errors import CliError, ExitCode
from kvcore.cli.options import add_config_option, load_config_arg
from kvcore.schemas import BackendContext
from kvcore.tenants import check_tenant_name


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("backend", metavar="NAME", help="the backend holding the store")
    sp.add_argument(
        "--tenant",
        default=None,
        metavar="TENANT",
        help="delete every object this tenant stored, of every namespace (default: every "
        "object of --namespace)",
    )
    add_config_option(sp, what="the backend's config")
    sp.add_argument(
        "--namespace",
        default="default",
        help="the engine namespace to open the store as, and to clear without --tenant "
        "(default: %(default)s)",
    )
    sp.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace, console: CommandConsole) -> int:

    if args.tenant is not None:
        try:
            check_tenant_name(args.tenant, "--tenant")
        except ValueError as exc:
            raise CliError(str(exc), ExitCode.USAGE) from None
    backend = open_for_cli(
        args.backend, load_config_arg(args.config), BackendContext(namespace=args.namespace)
    )
    try:
        removed = backend.clear(tenant=args.tenant)
    finally:
        backend.close()
    what = f"tenant {args.tenant!r}" if args.tenant else f"namespace {args.namespace!r}"
    if removed.failure:
        raise CliError(
            f"clearing {what} failed after {int(removed)} objects: {removed.failure}",
            ExitCode.FAILED,
        )
    if args.json:
        console.out.print_json(json.dumps({"cleared": what, "objects_removed": int(removed)}))
    else:
        console.out.print(f"cleared {what}: {int(removed)} objects removed")
    return ExitCode.OK
