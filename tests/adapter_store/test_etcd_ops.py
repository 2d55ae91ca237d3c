"""The catalog's transaction messages built directly are the ones aetcd's objects build."""

from aetcd import transactions as t

from services.adapter_store import etcd_ops
from services.adapter_store.blocking_etcd import txn_request


def test_checks_and_operations_match_aetcds():
    key, end = b"/k/", b"/k0"
    assert etcd_ops.absent(key) == (t.Create(key) == 0).build_message()
    assert etcd_ops.value_is(key, b"id") == (t.Value(key) == b"id").build_message()
    assert etcd_ops.mod_is(key, 7) == (t.Mod(key) == 7).build_message()
    assert etcd_ops.none_created_since(key, end, 41) == (t.Create(key, range_end=end) < 42).build_message()
    assert txn_request([], [etcd_ops.put(key, b"v"), etcd_ops.delete(key), etcd_ops.get(key, end)], []) == (
        txn_request([], [t.Put(key, b"v"), t.Delete(key), t.Get(key, range_end=end)], [])
    )


def test_messages_and_aetcd_objects_mix_in_one_transaction():
    request = txn_request(
        [etcd_ops.absent(b"a"), t.Mod(b"b") == 3], [t.Put(b"a", b"1"), etcd_ops.put(b"b", b"2")], []
    )
    assert [c.key for c in request.compare] == [b"a", b"b"]
    assert [op.request_put.key for op in request.success] == [b"a", b"b"]
