"""``loramesh adapters upload|list|delete``: manage adapters in the mesh's adapter store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loramesh_cli.errors import CommandError
from loramesh_cli.mesh_file import MeshFile
from loramesh_cli.table import render_table
from loramesh_cli.tls_options import cli_tls
from mesh_api.adapter_transfer import read_adapter_dir, ref_by_name, upload_adapter
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc, types_pb2
from services.runtime.tls import aio_channel

DEFAULT_OWNER = "admin"


def add_parsers(sub) -> None:
    adapters = sub.add_parser("adapters", help="upload, list and delete LoRA adapters")
    adapters.add_argument("--store", default="", help="adapter store address (default: from mesh.json)")
    adapters.add_argument("--owner", default=DEFAULT_OWNER, help="owner tenant (default: admin)")
    verbs = adapters.add_subparsers(dest="verb", required=True)
    upload = verbs.add_parser("upload", help="register a PEFT adapter directory")
    upload.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    upload.add_argument("--name", required=True, help="adapter name, unique per owner")
    upload.add_argument("--public", action="store_true", help="let every tenant use it")
    upload.set_defaults(func=cmd_upload)
    listing = verbs.add_parser("list", help="list adapters")
    listing.add_argument("--all-owners", action="store_true", help="every owner's adapters")
    listing.set_defaults(func=cmd_list)
    delete = verbs.add_parser("delete", help="delete an adapter")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_delete)


def _store_address(args) -> str:
    if args.store:
        return args.store
    mesh = MeshFile.read(Path(args.state_dir))
    if mesh is None or "adapter_store" not in mesh.services:
        raise CommandError("no mesh is up; start one with `loramesh up` or pass --store HOST:PORT")
    return mesh.services["adapter_store"].address


async def _with_stub(args, call):
    async with aio_channel(_store_address(args), cli_tls(args)) as channel:
        return await call(adapter_store_pb2_grpc.AdapterStoreStub(channel))


def cmd_upload(args) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        raise CommandError(f"{directory} is not a directory")
    files = read_adapter_dir(directory)
    visibility = types_pb2.VISIBILITY_PUBLIC if args.public else types_pb2.VISIBILITY_PRIVATE
    info = asyncio.run(
        _with_stub(args, lambda stub: upload_adapter(stub, files, args.name, args.owner, visibility))
    )
    print(f"registered {info.owner}/{info.name} id={info.id} rank={info.rank} "
          f"targets={','.join(info.target_modules)} {info.size_bytes} bytes sha256={info.sha256[:12]}")  # fmt: skip
    return 0


async def _list_all(stub, owner: str) -> list[types_pb2.AdapterInfo]:
    adapters, token = [], ""
    while True:
        reply = await stub.ListAdapters(
            pb.ListAdaptersRequest(owner=owner, include_public=bool(owner), page_size=1000, page_token=token)
        )
        adapters.extend(reply.adapters)
        token = reply.next_page_token
        if not token:
            return adapters


def cmd_list(args) -> int:
    owner = "" if args.all_owners else args.owner
    adapters = asyncio.run(_with_stub(args, lambda stub: _list_all(stub, owner)))
    visibility = {types_pb2.VISIBILITY_PUBLIC: "public"}
    print(
        render_table(
            ["NAME", "OWNER", "RANK", "TARGETS", "DTYPE", "BYTES", "VISIBILITY", "ID"],
            [
                [
                    a.name,
                    a.owner,
                    a.max_rank,
                    ",".join(t.removesuffix("_proj") for t in a.target_modules),
                    a.dtype,
                    a.size_bytes,
                    visibility.get(a.visibility, "private"),
                    a.id,
                ]
                for a in adapters
            ],
        )
    )
    return 0


def cmd_delete(args) -> int:
    reply = asyncio.run(
        _with_stub(
            args,
            lambda stub: stub.DeleteAdapter(pb.DeleteAdapterRequest(ref=ref_by_name(args.owner, args.name))),
        )
    )
    print(f"deleted {reply.adapter.owner}/{reply.adapter.name} id={reply.adapter.id}")
    return 0
