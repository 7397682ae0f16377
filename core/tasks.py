"""Tracked background tasks: the only place in the project that creates asyncio tasks.

Shadow legs, exchange finalisation and recording outlive the request handler that started them.
A bare ``asyncio.create_task`` can be garbage-collected mid-flight and is invisible at shutdown, so
every such task goes through :meth:`TaskSet.spawn`, which keeps a strong reference, logs
unexpected failures, and lets shutdown :meth:`TaskSet.drain` them within a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskSet:
    """A set of named tasks with strong references and a bounded drain."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Start ``coro`` as a tracked task; its exceptions are logged, never propagated."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failed += 1
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for running tasks, then cancel the rest; returns how many."""
        pending = set(self._tasks)
        if pending:
            _done, pending = await asyncio.wait(pending, timeout=timeout_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return len(pending)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
