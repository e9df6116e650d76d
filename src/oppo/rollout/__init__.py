"""The rollout role: sampling the policy, one engine step at a time, streaming chunks.

- :mod:`.engine`: oppo's eager engine (batched KV-cache sampling with slots) and its settings;
- :mod:`.static`: the static-shape engine (preallocated KV slots, a capturable decode step);
- :mod:`.ray`: the Ray rollout group, N workers hosting any registered backend;
- :mod:`.registry`: the backends by name (``generation.engine``);
- backends shipped as plugins in their own folders (see ``pyproject.toml``'s
  ``oppo.rollout_backends`` entry points).
"""
