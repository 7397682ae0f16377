"""Real vLLM (CPU build) as a backend for specshadow's tests, demo and benchmarks.

- ``setup``: vLLM's own virtual environment and the tiny deterministic models, cached outside the
  repo (``specshadow vllm setup``);
- ``build_model``: the standalone model-building script that runs inside that environment;
- ``server``: start, await and stop plain / n-gram / draft-model servers (``VllmServer``);
- ``cli``: ``specshadow vllm setup | serve | up``.

Nothing in this package imports vLLM or torch into the gateway's interpreter.
"""
