"""Two store replicas (real processes, a real etcd) under concurrent uploads and fetches while one
is killed with SIGKILL: every acknowledged upload is listed and fetched byte-identical, and no
fetch fails once retried on the other replica. A bounded slice of ``bench.cluster.store_nemesis``
(the issue's 200 uploads and 1,000 fetches run there), for the local-directory and the S3 tier."""

from __future__ import annotations

import pytest

from bench.cluster.store_nemesis import NemesisPlan, make_adapters, moto_bucket, run_nemesis, store_replicas

pytestmark = pytest.mark.integration

PLAN = NemesisPlan(uploads=40, fetches=200, concurrency=8)


@pytest.fixture(scope="module")
def nemesis_adapters(base_spec, tmp_path_factory):
    return make_adapters(base_spec, tmp_path_factory.mktemp("nemesis"), PLAN.uploads)


@pytest.fixture
def s3_bucket():
    with moto_bucket() as (url, env):
        yield url, env


async def run(etcd, tmp_path, adapters, seed: int, blob_store: str = "", env=None):
    replicas = store_replicas(etcd.endpoint, tmp_path, 2, blob_store, env)
    try:
        for replica in replicas:
            await replica.wait_ready()
        return await run_nemesis(replicas, adapters, NemesisPlan(**{**PLAN.__dict__, "seed": seed}))
    finally:
        for replica in replicas:
            replica.kill()


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_replica_killed_under_load_loses_no_acknowledged_upload(
    etcd, tmp_path, nemesis_adapters, seed
):
    report = await run(etcd, tmp_path, nemesis_adapters, seed)
    assert report.killed and report.acknowledged == PLAN.uploads, report
    assert report.holds, report


async def test_the_same_holds_with_blobs_in_s3(etcd, tmp_path, nemesis_adapters, s3_bucket):
    url, env = s3_bucket
    report = await run(etcd, tmp_path, nemesis_adapters, seed=3, blob_store=url, env=env)
    assert report.killed and report.acknowledged == PLAN.uploads, report
    assert report.holds, report
