"""The requests waiting to start on a worker, in the order they wait.

A saturated worker queues hundreds of requests, and every step the scheduler reads the queue
(the batch policy's view, the stats) and takes a few off it. So each request's policy view
(:class:`QueuedRequest`) is made once, when it joins the queue, and the tuple the policies see
is rebuilt only after the queue changed, by copying those views (no Python per waiting request);
taking a request off is O(1) by id, not a scan of a deque.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from services.gpu_worker.engine.policies.batch_policy import QueuedRequest
from services.gpu_worker.engine.request import EngineRequest


class WaitingQueue:
    """Waiting requests in order; a waiting request does not change (it is off the queue while it
    runs and comes back, preempted, through :meth:`appendleft`)."""

    def __init__(self, describe: Callable[[EngineRequest], QueuedRequest]):
        """``describe``: the batch policy's view of a request, taken when it joins."""
        self._describe = describe
        self._requests: OrderedDict[str, EngineRequest] = OrderedDict()
        self._views: dict[str, QueuedRequest] = {}
        self._view: tuple[QueuedRequest, ...] | None = ()
        self._adapter_ids: tuple[str | None, ...] | None = ()
        self._ids: tuple[str, ...] | None = ()

    def append(self, request: EngineRequest) -> None:
        """Queue ``request`` last."""
        self._add(request)

    def appendleft(self, request: EngineRequest) -> None:
        """Queue ``request`` first (a preempted request goes back to the front)."""
        self._add(request)
        self._requests.move_to_end(request.request_id, last=False)

    def remove(self, request: EngineRequest) -> None:
        """Take ``request`` off the queue; ValueError when it is not on it."""
        if self._requests.pop(request.request_id, None) is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        del self._views[request.request_id]
        self._changed()

    def get(self, request_id: str) -> EngineRequest | None:
        return self._requests.get(request_id)

    def view(self) -> tuple[QueuedRequest, ...]:
        """The batch policy's view of the queue, in order (rebuilt only after a change)."""
        if self._view is None:
            views = self._views
            self._view = tuple(views[request_id] for request_id in self._requests)
        return self._view

    def ids(self) -> tuple[str, ...]:
        """The waiting requests' ids, in order (rebuilt only after a change)."""
        if self._ids is None:
            self._ids = tuple(self._requests)
        return self._ids

    def adapter_ids(self) -> tuple[str | None, ...]:
        """Each waiting request's adapter, in order (the stats' ``waiting_adapters``)."""
        if self._adapter_ids is None:
            self._adapter_ids = tuple(view.adapter_id for view in self.view())
        return self._adapter_ids

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __contains__(self, request: object) -> bool:
        return isinstance(request, EngineRequest) and self._requests.get(request.request_id) is request

    def _add(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._requests[request.request_id] = request
        self._views[request.request_id] = self._describe(request)
        self._changed()

    def _changed(self) -> None:
        self._view = None
        self._adapter_ids = None
        self._ids = None
