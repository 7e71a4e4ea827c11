"""The connector's store queue: bounded, never blocks the caller, read-your-writes, counts to zero."""

from __future__ import annotations

import threading

import pytest
import torch

from connector.store_queue import StoreQueue
from kvstore.backend import BackendError
from kvstore.backends.memory import CPUBackend
from kvstore.storage_manager import StorageManager


class _GatedTier(CPUBackend):
    """A real CPU tier whose puts wait for a gate: a slow tier, deterministically."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()  # a put is blocked on the gate
        self.fail = False

    def _wait(self) -> None:
        self.entered.set()
        self.gate.wait(30)
        if self.fail:
            raise BackendError("disk full")

    def batched_put(self, items, *, owned=False) -> list[bool]:  # the queue hands its chunks over
        self._wait()
        return super().batched_put(items, owned=owned)


def chunk(tokens: int = 4) -> torch.Tensor:
    return torch.randn(2, 2, tokens, 1, 8)


def test_bounded_by_bytes_and_read_your_writes():
    tier = _GatedTier()
    storage = StorageManager([tier])
    one = chunk()
    nbytes = one.numel() * one.element_size()
    q = StoreQueue(storage, max_jobs=8, max_bytes=2 * nbytes)
    done = []
    assert q.submit([("a", one)], lambda: done.append("a"))  # returns at once: the tier is gated
    assert q.submit([("b", chunk())], lambda: done.append("b"))
    assert not q.submit([("c", chunk())])  # over the byte bound: refused, nothing queued
    assert q.pending() == 2 and q.is_pending("a") and not q.is_pending("c")
    assert storage.batched_contains(["a"]) == [False]

    waiter = threading.Thread(target=q.wait_for, args=(["b"],))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # a lookup needing "b" waits for its store...
    tier.gate.set()
    waiter.join(30)
    assert not waiter.is_alive()
    assert storage.batched_contains(["a", "b", "c"]) == [True, True, False]  # ...and then finds it
    assert torch.equal(storage.fetch(["a"])[0][0], one)
    assert q.flush(30) and q.pending() == 0 and done == ["a", "b"]
    assert q.submit([("c", chunk())])  # bytes released: room again
    q.close()
    assert storage.batched_contains(["c"]) == [True]
    storage.close()


def test_bounded_by_jobs_and_failed_puts_release_their_keys():
    tier = _GatedTier()
    storage = StorageManager([tier])
    q = StoreQueue(storage, max_jobs=1, max_bytes=1 << 30)
    assert q.submit([("a", chunk())])  # taken by the worker (blocked on the gate) or queued
    results = [q.submit([(f"k{i}", chunk())]) for i in range(3)]
    assert results.count(False) >= 2  # the job queue holds one: the rest are dropped
    tier.gate.set()
    assert q.flush(30) and q.pending() == 0
    # A tier that raises: the storage manager turns it into a miss; the key is released.
    tier.fail = True
    assert q.submit([("z", chunk())])
    assert q.flush(30) and q.pending() == 0 and not q.is_pending("z")
    q.close()
    storage.close()


@pytest.mark.parametrize("policy", ["drop_new", "drop_oldest"])
def test_a_dropped_store_releases_its_keys_under_every_queue_policy(policy):
    tier = _GatedTier()
    storage = StorageManager([tier])
    q = StoreQueue(storage, max_jobs=1, max_bytes=1 << 30, queue_full=policy)
    dropped = []
    assert q.submit([("a", chunk())])
    assert tier.entered.wait(30)  # "a" is on the worker, blocked: the queue itself is empty
    assert q.submit([("b", chunk())], on_drop=lambda: dropped.append("b"))  # queued
    third = q.submit([("c", chunk())], on_drop=lambda: dropped.append("c"))  # the queue is full
    # drop_new refuses "c"; drop_oldest queues "c" and drops "b". Either way the dropped
    # store's key is released at once, so a lookup waiting for it does not hang.
    gone = "c" if policy == "drop_new" else "b"
    assert third == (policy == "drop_oldest")
    assert dropped == ([] if policy == "drop_new" else ["b"])
    assert not q.is_pending(gone) and q.is_pending("a")
    waiter = threading.Thread(target=q.wait_for, args=([gone],))
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive()  # returned while "a" is still blocked on the tier
    assert q.pending() == 2
    tier.gate.set()
    assert q.flush(30) and q.pending() == 0
    assert storage.batched_contains(["a", "b", "c"]) == [True, policy == "drop_new", policy == "drop_oldest"]
    q.close()
    storage.close()
