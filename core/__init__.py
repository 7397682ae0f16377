"""specshadow's neutral core: the vocabulary and the pure mechanics every other package shares.

Owns the JSON codec (``jsonx``), ids (``ids``), summary statistics (``stats``), tracked tasks
(``tasks``), the SSE decoder (``sse``), the stream recorder and the one definition of every timing
(``recorder``, ``timings``), the exchange / leg / evidence vocabulary with the role, route and
capture literals (``exchange``, ``evidence``), header names (``wire``), exchange sinks
(``sinks``), deterministic sampling by hash (``sample``) and the child-process supervisor
(``procs``).

It imports nothing else of the project (checked by ``tests/test_architecture.py``); every other
package may import it. See docs/architecture.md.
"""
