"""``loramesh adapters upload|import|list|delete|pin|unpin``: the calling tenant's adapters, through
the gateway.

The CLI is a client like any other (:class:`loramesh.Client`): the gateway maps its API key to a
tenant, which owns what it uploads and may list, delete and pin only its own adapters (listings also
show every tenant's public ones). No flag names another owner: to act for tenant ``bob``, use
bob's key. The local mesh's ``admin_api_key`` (mesh.json) is the ``admin`` tenant's key, nothing
more.

Gateway and key as for ``loramesh generate``: ``--gateway``, else the local mesh's gateways
(mesh.json); ``--api-key``, else ``$LORAMESH_API_KEY``, else mesh.json's admin key (only ever
sent to that mesh's own gateways).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loramesh.client import LIST_PAGE_SIZE, check_adapter_dir
from loramesh_cli.errors import CommandError
from loramesh_cli.gateway_client import add_connection_flags, gateway_client
from loramesh_cli.table import render_table

UPLOAD_TIMEOUT_S = 300.0
"""The whole upload (up to the store's size limit, 256 MiB by default, in messages of
``mesh_api.upload_wire.UPLOAD_CHUNK_BYTES``)."""


class _Removed(argparse.Action):
    """A flag of the former CLI, which called the adapter store directly: refused, saying what
    to do instead (argparse alone would misread ``--owner bob upload`` as the verb ``bob``)."""

    def __init__(self, option_strings, dest, instead: str, nargs=None, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was removed: {self.instead}")


def add_parsers(sub) -> None:
    adapters = sub.add_parser(
        "adapters",
        help="upload, list, delete and pin the calling tenant's LoRA adapters (through the gateway)",
        description="The API key's tenant owns what it uploads; to act for another tenant, use its key.",
    )
    # Accepted before the verb and after it (the verb's copy only overrides when given).
    add_connection_flags(adapters)
    adapters.add_argument("--owner", action=_Removed, instead="the owner is the API key's tenant: "
                          "to act for a tenant, pass its key with --api-key")  # fmt: skip
    adapters.add_argument("--store", action=_Removed, instead="the CLI goes through the gateway: "
                          "--gateway HOST:PORT")  # fmt: skip
    verbs = adapters.add_subparsers(dest="verb", required=True)
    upload = verbs.add_parser("upload", help="register a PEFT adapter directory for the caller's tenant")
    upload.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    upload.add_argument("--name", required=True, help="adapter name, unique per tenant")
    upload.add_argument("--public", action="store_true", help="let every tenant use it (as owner/name)")
    upload.set_defaults(func=cmd_upload)
    imported = verbs.add_parser(
        "import", help="have the adapter store import a PEFT adapter from an s3://, hf:// or file:// URI"
    )
    imported.add_argument("uri", help="s3://bucket/prefix, hf://org/repo[@revision][/subdir] or file:///abs/path "
                          "(on the store's machine), as the store's import policy grants the tenant")  # fmt: skip
    imported.add_argument("--name", required=True, help="adapter name, unique per tenant; an adapter "
                          "already under it is kept if unchanged, else replaced by the next version")  # fmt: skip
    imported.add_argument("--public", action="store_true", help="let every tenant use it (as owner/name)")
    imported.set_defaults(func=cmd_import)
    listing = verbs.add_parser("list", help="the caller's adapters and every tenant's public ones")
    listing.add_argument("--all-owners", action=_Removed, nargs=0, instead="a tenant sees its own "
                         "adapters and the public ones, nothing more")  # fmt: skip
    listing.add_argument("--page-size", type=int, default=0, metavar="N",
                         help="list one page of at most N adapters (at most 1000) and the token of the "
                              "next; 0: every page")  # fmt: skip
    listing.add_argument("--page-token", default="", metavar="TOKEN",
                         help="the page after the one that printed TOKEN (with --page-size)")  # fmt: skip
    listing.set_defaults(func=cmd_list)
    delete = verbs.add_parser("delete", help="delete one of the caller's adapters")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_delete)
    pin = verbs.add_parser("pin", help="pin one of the caller's adapters: the adapter store and the "
                           "workers never evict it from their caches")  # fmt: skip
    pin.add_argument("name")
    pin.set_defaults(func=cmd_pin, pinned=True)
    unpin = verbs.add_parser(
        "unpin", help="unpin one of the caller's adapters: the caches may evict it again"
    )
    unpin.add_argument("name")
    unpin.set_defaults(func=cmd_pin, pinned=False)
    for verb in (upload, imported, listing, delete, pin, unpin):
        add_connection_flags(verb, override_only=True)


def local_adapter_dir(path: str | Path) -> Path:
    """``path`` once it looks like a PEFT adapter directory (checked here, before anything is
    sent); a :class:`CommandError` naming it and what it lacks otherwise."""
    try:
        return check_adapter_dir(path)
    except OSError as error:
        raise CommandError(str(error)) from None


def cmd_upload(args) -> int:
    directory = local_adapter_dir(args.dir)
    with gateway_client(args) as client:
        a = client.adapters.upload(directory, args.name, public=args.public, timeout=UPLOAD_TIMEOUT_S)
    print(f"registered {a.owner}/{a.name} id={a.id} rank={a.rank} targets={','.join(a.target_modules)} "
          f"{a.size_bytes} bytes sha256={a.sha256[:12]}{' public' if a.public else ''}")  # fmt: skip
    return 0


def cmd_import(args) -> int:
    with gateway_client(args) as client:
        imported = client.adapters.import_uri(
            args.uri, args.name, public=args.public, timeout=UPLOAD_TIMEOUT_S
        )
    a = imported.adapter
    outcome = (
        f"imported {a.owner}/{a.name} version {a.version}"
        if imported.changed
        else (f"unchanged {a.owner}/{a.name} version {a.version} (same content)")
    )
    print(f"{outcome} id={a.id} rank={a.rank} targets={','.join(a.target_modules)} {a.size_bytes} bytes "
          f"sha256={a.sha256[:12]}{' public' if a.public else ''}")  # fmt: skip
    return 0


def cmd_list(args) -> int:
    paged = bool(args.page_size or args.page_token)
    with gateway_client(args) as client:
        if paged:
            page = client.adapters.list_page(
                page_size=args.page_size or LIST_PAGE_SIZE, page_token=args.page_token
            )
            adapters, total = list(page.adapters), page.total
        else:
            adapters = client.adapters.list()
            total = len(adapters)
    if paged:  # on stderr: stdout stays the table alone
        more = f"next page: --page-token {page.next_page_token}" if page.next_page_token else "last page"
        print(f"{len(adapters)} of {total} adapters; {more}", file=sys.stderr)
    if not total:
        print("no adapters: this tenant has none and no tenant has a public one")
        return 0
    if not adapters:
        return 0
    print(
        render_table(
            ["NAME", "OWNER", "RANK", "TARGETS", "DTYPE", "BYTES", "VISIBILITY", "SHA256", "ID"],
            [
                [
                    a.name,
                    a.owner,
                    a.max_rank,
                    ",".join(t.removesuffix("_proj") for t in a.target_modules),
                    a.dtype,
                    a.size_bytes,
                    "public" if a.public else "private",
                    a.sha256[:12],
                    a.id,
                ]
                for a in adapters
            ],
        )
    )
    return 0


def cmd_pin(args) -> int:
    with gateway_client(args) as client:
        a = client.adapters.pin(args.name) if args.pinned else client.adapters.unpin(args.name)
    print(f"{'pinned' if a.pinned else 'unpinned'} {a.owner}/{a.name} id={a.id} {a.size_bytes} bytes")
    return 0


def cmd_delete(args) -> int:
    with gateway_client(args) as client:
        a = client.adapters.delete(args.name)
    print(f"deleted {a.owner}/{a.name} id={a.id}")
    return 0
