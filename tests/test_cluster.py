"""A NATS cluster of 3 losing a node under load: streams replicated 3 times, workers and clients on
every node; the streams in flight finish and new requests are served."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from bus.client import open_client
from bus.connection import connect
from bus.server import EmbeddedNatsCluster
from bus.settings import NatsSettings
from bus.streams import declare_all_when_ready
from bus.subjects import Names
from tests.conftest import bus_settings
from tests.pipeline_helpers import (
    ask_to_the_end,
    assert_all_whole,
    seconds_until_served,
    wait_for_workers,
    worker_processes,
)


async def test_a_cluster_node_dying_under_load_loses_no_request(tmp_path: Path) -> None:
    settings = bus_settings(stream_replicas=3, registry_ttl_s=3.0, heartbeat_timeout_s=10.0, ack_wait_s=4.0)
    cluster = EmbeddedNatsCluster(tmp_path, size=3)
    cluster.start()
    try:
        nc = await connect(NatsSettings(urls=cluster.urls), name="cluster-setup")
        try:  # once the nodes have elected a JetStream meta leader
            await declare_all_when_ready(nc.jetstream(), Names(settings.namespace), settings, nc.max_payload, timeout_s=30)
        finally:
            await nc.close()
        # Each worker connects to a random node of the list.
        stages = ["processor", "processor", "decode", "decode"]
        async with open_client(NatsSettings(urls=cluster.urls), settings, "cluster-test") as client, \
                worker_processes(cluster.urls, settings.namespace, stages, CONVEYOR_STREAM_REPLICAS="3") as workers:
            await wait_for_workers(client, num_workers=4, timeout_s=90)
            assert (await ask_to_the_end(client, max_tokens=5)).usage.completion_tokens == 5

            # The node to lose is the registry's leader, the worst case: the bucket has none for seconds, every
            # card lapses meanwhile, and processors must not take that for workers gone.
            doomed = await registry_leader(cluster, Names(settings.namespace))
            in_flight = [asyncio.create_task(ask_to_the_end(client, max_tokens=300)) for _ in range(20)]
            await asyncio.sleep(0.5)
            cluster.nodes[doomed].halt(signal.SIGKILL)
            lost_at = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*in_flight, return_exceptions=True), timeout=90)
            assert_all_whole(outcomes, completion_tokens=300)
            first_served_s = await seconds_until_served(client, since_s=lost_at)
            finals = await asyncio.gather(*(ask_to_the_end(client, max_tokens=4) for _ in range(10)))
            assert all(worker.poll() is None for worker in workers), "a worker died with the node"
        assert all(final.usage.completion_tokens == 4 for final in finals)
        assert first_served_s < 15, first_served_s
    finally:
        cluster.stop()


async def registry_leader(cluster: EmbeddedNatsCluster, names: Names) -> int:
    """The index of the node leading the registry bucket's stream (nodes are named n0, n1, ...)."""
    nc = await connect(NatsSettings(urls=cluster.urls), name="cluster-leader")
    try:
        info = await nc.jetstream().stream_info(names.registry_stream)
    finally:
        await nc.close()
    assert info.cluster is not None and info.cluster.leader is not None, info
    return int(info.cluster.leader.removeprefix("n"))
