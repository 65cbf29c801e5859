"""Step-time model of a continuously batching engine.

One scheduler step runs every scheduled request together, so its duration is

    step_s = a + b * prefill_tokens + c * decode_seqs + d * kv_blocks_read + e * cpu_loaded_blocks

where ``prefill_tokens`` are the uncached prompt tokens computed in the step (a chunk
of at most ``max_num_batched_tokens``), ``decode_seqs`` the requests producing their
next token, and ``kv_blocks_read`` the KV blocks of every scheduled request (its
context, cached prefix included, which attention must read). TTFT is then not a
per-request constant: it is the queueing before admission plus the steps that
prefill the *uncached* part of the prompt, shared with everything else in the batch.
``cpu_loaded_blocks`` are prefix blocks copied back from the CPU offload tier in the
step (see :class:`loadtest.sim.block_manager.CpuOffloadTier`): they cost their
transfer instead of their prefill.

Defaults resemble an 8B-class model (Llama-3-8B / Qwen3-8B, bf16) on one H100, read
off the fit in Dynamo's mocker (quoted in DESIGN.md):

* prefill (ms) = 1.25e-6 n^2 + 7.41e-2 n + 26.2: the linear term gives ``b`` =
  74.1 us per prefill token; the quadratic term (attention) adds 12% at 8k tokens
  and is left out, so long single prompts come out slightly optimistic.
* decode step (ms) = -5.47 a^2 + 43.88 a + 19.44 for KV usage a: the intercept is
  the fixed cost of a step, ``a`` = 20 ms (between the decode 19.4 and prefill
  26.2 intercepts); the growth to a full cache, 38.4 ms, spread over the ~30,000
  16-token blocks an 8B model's KV cache holds on an 80 GB H100 (128 KiB per
  token, ~60 GB), gives ``d`` = 1.3 us per block read.
* the mocker has no per-sequence term; decode on an H100 stays weight-bound until
  a batch of a few hundred, so ``c`` = 0.06 ms per decoding sequence (256
  sequences add 15 ms).

* a CPU -> GPU load moves a block's KV over PCIe. An 8B-class model keeps 128 KiB
  per token (2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes), so a 16-token
  block is 2 MiB; at ~25 GB/s, what pinned host-to-device copies reach on PCIe 5.0
  x16 in practice, that is 2 MiB / 25 GB/s = 84 us: ``e`` = 84 us per block, about
  1/14 of prefilling the block's 16 tokens (1.19 ms).

All five are configurable (``--step-overhead-ms``, ``--prefill-us-per-token``,
``--decode-us-per-seq``, ``--kv-read-us-per-block``, ``--cpu-load-us-per-block``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyModel:
    step_overhead_s: float = 20e-3
    prefill_s_per_token: float = 74.1e-6
    decode_s_per_seq: float = 60e-6
    kv_read_s_per_block: float = 1.3e-6
    cpu_load_s_per_block: float = 84e-6

    def prefill_alone_s(self, tokens: int, max_num_batched_tokens: int) -> float:
        """Engine seconds to the first token of a prompt with ``tokens`` uncached tokens on an
        idle engine: one step per chunk of the token budget, nothing else in the batch.

        The TTFT floor no router can beat: the bench's reference next to the ideal ratio.
        """
        steps = max(1, -(-tokens // max_num_batched_tokens))
        return steps * self.step_overhead_s + self.prefill_s_per_token * tokens

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_blocks_read: int, cpu_loaded_blocks: int = 0) -> float:
        """Modelled seconds of one step (engine time, before ``--speedup``)."""
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
            + self.kv_read_s_per_block * kv_blocks_read
            + self.cpu_load_s_per_block * cpu_loaded_blocks
        )
