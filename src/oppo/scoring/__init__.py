"""The scoring roles: reward, reference and critic, one-shot or streamed chunk by chunk.

- :mod:`.streaming`: the scorers themselves (one-shot ``score_full``, the streaming
  :class:`~.streaming.StreamingScorer` with its KV slots);
- :mod:`.worker`: the scorer worker and its local transports (inline, thread, child process),
  and the critic trained beside its scoring;
- :mod:`.ray`: the same scorers in Ray actors.
"""
