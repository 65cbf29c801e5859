"""A simulated vLLM fleet: the real HTTP surface and KV-event wire, a true prefix cache.

Modules, one job each:

* :mod:`loadtest.sim.block_manager`: vLLM's block pool and prefix-cache bookkeeping.
* :mod:`loadtest.sim.latency`: the step-time model of continuous batching.
* :mod:`loadtest.sim.engine`: the scheduler step loop (admission, chunked prefill, decode).
* :mod:`loadtest.sim.generation`: deterministic output tokens.
* :mod:`loadtest.sim.publisher`: ZMQ PUB of KV events and the replay ROUTER.
* :mod:`loadtest.sim.metrics`: the ``vllm:*`` Prometheus metrics.
* :mod:`loadtest.sim.faults`: fault injection (kill, pause, dropped events, latency, errors).
* :mod:`loadtest.sim.http`: the FastAPI app of ``vllm serve``.
* :mod:`loadtest.sim.apis`: its ``/v1/responses`` (stored responses) and ``/v1/messages``.
* :mod:`loadtest.sim.fields`: request fields and errors as vLLM checks and answers them.
* :mod:`loadtest.sim.world_clock`: the clock the bench's oracle stops while it asks (engines and client).
* :mod:`loadtest.sim.cli`: ``kvrouter sim``, K engines in one asyncio process.
"""
