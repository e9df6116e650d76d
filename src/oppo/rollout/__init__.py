"""The rollout role: sampling the policy, one engine step at a time, streaming chunks.

- :mod:`.registry`: the backend specs by name (``generation.backend``; each with its settings
  ``rollout.<name>.*``, checks, build and probe) and :class:`~.registry.BackendSettings`, what every
  backend shares;
- :mod:`.engine`: oppo's eager engine (batched KV-cache sampling with slots), :mod:`.eager` its spec;
- :mod:`.chunks`: the chunks every stepwise backend streams to the scorers;
- :mod:`.static`: the static-shape engine (preallocated KV slots, a capturable decode step);
- :mod:`.ray`: the Ray rollout group, N replicas hosting any registered backend;
- backends shipped as plugins in their own folders (``vllm/``; ``pyproject.toml``'s
  ``oppo.rollout_backends`` entry points).
"""
