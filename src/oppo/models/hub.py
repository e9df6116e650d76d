"""The Hugging Face hub seen from a run: whether it can be reached, whether a name is in the local
cache, and offline mode switched on when every hub model is cached.

One TCP connection to the hub endpoint, with a short timeout, tells within seconds whether the hub
is reachable; a hub name missing from the cache is then one clear line about the network instead
of Hugging Face's long retries and a message about a missing tokenizer."""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_REACHABLE: dict[str, bool] = {}


def offline_env() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in _OFFLINE_ENV)


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds (cached per
    endpoint for the process). False at once in offline mode (``HF_HUB_OFFLINE=1``).

    Name resolution has no timeout of its own, so the probe runs on a daemon thread and is given
    up on after ``timeout``: a machine without network answers in seconds either way.
    """
    if offline_env():
        return False
    endpoint = hub_endpoint()
    if endpoint in _REACHABLE:
        return _REACHABLE[endpoint]
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, name="oppo-hub-probe", daemon=True)
    t.start()
    t.join(timeout + 0.5)
    _REACHABLE[endpoint] = bool(result and result[0])
    return _REACHABLE[endpoint]


def go_offline() -> None:
    """Make Hugging Face read only its local cache, in this process and in the ones it starts."""
    for k in _OFFLINE_ENV:
        os.environ[k] = "1"
    try:
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True  # read at call time by huggingface_hub and transformers
    except ImportError:  # pragma: no cover - transformers depends on it
        pass


def in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    try:
        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id, an unreadable cache: not cached
        return False
    return isinstance(hit, str)


def hub_problems(hub_names: list[tuple[str, str]], dataset: str | None = None) -> list[str]:
    """``hub_names``: (setting, hub name) of each model that is not a local path; ``dataset``: a
    prompt set that names a hub dataset. Each name not in the local cache when the hub cannot be
    reached is a problem; when it cannot and every hub model is cached, offline mode goes on."""
    problems = []
    missing = [(k, name) for k, name in hub_names if not in_hub_cache(name)]
    if (missing or dataset) and not hub_reachable():
        why = ("offline mode is on (HF_HUB_OFFLINE)" if offline_env()
               else f"no network: {hub_endpoint()} cannot be reached")
        for key, name in missing:
            problems.append(f"{key}={name!r} is a hub name that is not in the local Hugging Face cache, and {why}. "
                            f"Download it where there is network (hf download {name} --local-dir DIR) and give "
                            f"the local directory: {key}=/local/dir.")
        if dataset:
            problems.append(f"data.prompts={dataset!r} is not a local file, so it would be a hub dataset, "
                            f"and {why}. Give a local JSONL file (data.prompts=/local/prompts.jsonl).")
    elif hub_names and not missing and not hub_reachable():
        go_offline()  # every hub model is cached: load from the cache without retrying the network
    return problems
