"""What a worker that runs for months gives back when its subscriptions come and go."""

from __future__ import annotations

import gc
import weakref

from tests.conftest import Endpoint, make_sub
from tests.helpers import eventually
from worker.cli.worker import GC_THRESHOLD


async def test_a_released_subscription_is_freed_under_the_workers_collector_settings(
        start_worker, endpoint: Endpoint, client, topic):
    """A dispatcher, its consumer and its tasks refer to each other. Under the worker's collector
    settings only a full collection frees them once they are old, and that came after about 100
    million allocations: a quiet worker whose subscriptions came and went grew by about 30 KiB for
    each."""
    previous = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        sub = make_sub(topic, endpoint.url)
        w = await start_worker(sub)
        [mid] = client.publish(topic, [b"one"])
        await eventually(lambda: any(r.acked for r in endpoint.by_id().get(mid, [])), what="delivered")
        released = weakref.ref(w.dispatchers[sub.key])
        gc.collect()  # old now: from here only a full collection reaches it
        await w.remove(sub.key)
        await eventually(lambda: released() is None, timeout=5, what="the released dispatcher freed")
    finally:
        gc.set_threshold(*previous)
