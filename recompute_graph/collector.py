"""Planning with the garbage collector's full passes held back.

Planning makes millions of short-lived Python objects (Dynamo's and AOTAutograd's capture, the
planner's pool of simulated schedules). CPython starts a full collection, a walk over every tracked
object of the process, each time ``threshold2`` younger collections have run and the objects that
survived them exceed a quarter of the oldest generation. Inside ``torch.compile`` of ResNet-152 that was
13 full collections over up to 850,000 objects, 1.7 s of a 30 s plan, and 1.3 s of them went over objects
that were alive before planning began and outlive it.

:func:`full_collections_deferred` leaves those older objects out of the passes (``gc.freeze``) and
raises ``threshold2`` to :data:`DEFERRED_FULL_COLLECTION_THRESHOLD` while the block runs; the young
generations are collected as usual, so short-lived cycles are still freed. Both are handed back after.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["DEFERRED_FULL_COLLECTION_THRESHOLD", "full_collections_deferred", "every_object_seen"]

#: ``threshold2`` while planning (CPython's default is 10): a full pass after this many middle-generation
#: collections, about one per 700,000 allocations that survived two collections
DEFERRED_FULL_COLLECTION_THRESHOLD = 1000


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Run the block with the objects alive before it frozen out of the collector (``gc.freeze``) and
    full collections ``DEFERRED_FULL_COLLECTION_THRESHOLD / threshold2`` times rarer; both handed back
    after, also on an error. Nested blocks and a caller's own frozen objects are left alone (unfreezing
    would hand theirs back too): the freeze is skipped when objects are frozen already. A threshold the
    caller set higher is kept."""
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    if len(thresholds) == 3 and thresholds[2] < DEFERRED_FULL_COLLECTION_THRESHOLD:
        gc.set_threshold(thresholds[0], thresholds[1], DEFERRED_FULL_COLLECTION_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()


@contextlib.contextmanager
def every_object_seen() -> Iterator[None]:
    """The block with the frozen objects back in the collector's view (``gc.get_referrers`` does not
    search frozen ones: a global list the model fills was invisible inside :func:`full_collections_deferred`),
    frozen again after."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()
