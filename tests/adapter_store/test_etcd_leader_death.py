"""An upload to a store replica whose etcd leader dies as it arrives gets an answer: the commit's
etcd call, in flight when the catalog's watch failed and reset the shared etcd client, ends as
UNAVAILABLE naming the reset (the gateway tries another replica), not as a cancellation that
ended the RPC with no status at all (its caller waited out its whole deadline: the nemesis's
180 s upload after a node kill took etcd-0, the leader, with it).

Real parts: a three-member etcd cluster on loopback, the leader first in the replica's endpoint
list (as etcd-0 in the overlay), a real store replica, the upload over gRPC. The leader is
killed just before the upload is sent; on this machine the commit is reached well before the
watch's failure resets the client (every run before the fix waited out its deadline). On a
machine slow enough for the reset to come first, the commit goes to a live member and the test
passes without meeting the race.
"""

from __future__ import annotations

import grpc
import pytest
from grpc import aio
from support.etcd_cluster import etcd_cluster
from support.polling import HANG_GUARD_S
from support.store_replicas import store_replicas

from mesh_api.upload_wire import WireUploadAdapterStoreStub, upload_wire


@pytest.mark.integration
async def test_an_upload_meeting_the_etcd_leaders_death_is_answered(tmp_path, sample_files):
    with etcd_cluster(tmp_path / "etcd") as cluster:
        cluster.members.insert(0, cluster.members.pop(cluster.leader()))
        async with (
            store_replicas(tmp_path / "stores", cluster.endpoints, count=1) as replica,
            aio.insecure_channel(replica.addresses[0]) as channel,
        ):
            store = WireUploadAdapterStoreStub(channel)
            await store.RegisterAdapter(
                upload_wire(sample_files, "before", owner="alice"), timeout=HANG_GUARD_S
            )
            cluster.members[0].kill()
            try:
                reply = await store.RegisterAdapter(
                    upload_wire(sample_files, "during", owner="alice"), timeout=HANG_GUARD_S
                )
                answer = "OK: " + reply.adapter.name
            except aio.AioRpcError as error:
                answer = f"{error.code().name}: {error.details()}"
    assert answer == "OK: during" or (
        answer.startswith(grpc.StatusCode.UNAVAILABLE.name) and "etcd" in answer
    ), answer
