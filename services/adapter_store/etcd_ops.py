"""A transaction's checks and operations as etcd's own protobuf messages, built directly.

A registration's commit holds about five checks and six writes; built as aetcd's
``transactions`` objects and converted to messages when sent, each costs an object, its
``build_message`` and a type dispatch (about 30 µs of a replica's CPU a registration, issue 48).
:func:`.blocking_etcd.txn_request` sends these messages as they are, beside aetcd's objects (which
other modules still give it).
"""

from __future__ import annotations

from aetcd import rpc


def put(key: bytes, value: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))


def delete(key: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def get(key: bytes, range_end: bytes = b"") -> rpc.RequestOp:
    """Read ``key`` (every key in ``[key, range_end)`` when ``range_end`` is given)."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=range_end))


def value_is(key: bytes, value: bytes) -> rpc.Compare:
    return rpc.Compare(key=key, target=rpc.Compare.VALUE, result=rpc.Compare.EQUAL, value=value)


def mod_is(key: bytes, revision: int) -> rpc.Compare:
    """``key`` was last written at ``revision`` (0: it does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def absent(key: bytes) -> rpc.Compare:
    """``key`` does not exist (its create revision is 0)."""
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)


def none_created_since(key: bytes, range_end: bytes, revision: int) -> rpc.Compare:
    """No key of ``[key, range_end)`` was created after ``revision``."""
    return rpc.Compare(
        key=key,
        range_end=range_end,
        target=rpc.Compare.CREATE,
        result=rpc.Compare.LESS,
        create_revision=revision + 1,
    )
