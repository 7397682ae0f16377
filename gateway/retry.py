"""The one retry policy (tenacity): connection establishment failures only.

Only failures where the upstream cannot have started work are retried — a refused or unreachable
connection. Timeouts, resets after the request was sent, and anything after the client got a byte
are never retried: a re-sent completion may be billed twice.
"""

from __future__ import annotations

import logging

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from gateway.settings import UpstreamSettings

log = logging.getLogger(__name__)

RETRYABLE = (aiohttp.ClientConnectorError,)


def _is_connect_failure(exc: BaseException) -> bool:
    # A certificate error will not heal by retrying.
    return isinstance(exc, RETRYABLE) and not isinstance(
        exc, aiohttp.ClientConnectorCertificateError
    )


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.info("retrying upstream connect (attempt %d): %r", state.attempt_number, exc)


def connect_retrying(settings: UpstreamSettings, *, first_failed: bool = False) -> AsyncRetrying:
    """A fresh ``AsyncRetrying`` for one request's connect phase.

    ``first_failed``: the caller already made (and lost) the first attempt, so one fewer remains.
    """
    # A connect timeout is excluded on purpose: waiting connect_timeout_s again per attempt would
    # multiply the client's wait; it surfaces as a 504 at once.
    retryable = retry_if_exception(_is_connect_failure)
    return AsyncRetrying(
        retry=retryable,
        stop=stop_after_attempt(max(1, settings.retry_attempts - int(first_failed)))
        | stop_after_delay(settings.retry_deadline_s),
        wait=wait_exponential_jitter(
            multiplier=settings.retry_initial_s,
            max=settings.retry_max_s,
            jitter=settings.retry_initial_s,
        ),
        reraise=True,
        before_sleep=_log_retry,
    )
