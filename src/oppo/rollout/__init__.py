"""The rollout role: sampling the policy, one decode step at a time, streaming chunks.

- :mod:`.registry`: the backend specs by name (``generation.backend``; each with its settings
  ``rollout.<name>.*``, checks, build and probe) and :class:`~.registry.BackendSettings`, what every
  backend shares;
- :mod:`.eager`: oppo's eager backend (batched KV-cache sampling with slots; :mod:`.eager.backend`);
- :mod:`.chunks`: the chunks every stepwise backend streams to the scorers;
- :mod:`.static`: the static-shape backend, built on the eager one (preallocated KV slots, a
  capturable decode step);
- :mod:`.ray`: the Ray rollout group, N replicas hosting any registered backend;
- backends shipped as plugins in their own folders (``vllm/``; ``pyproject.toml``'s
  ``oppo.rollout_backends`` entry points).
"""
