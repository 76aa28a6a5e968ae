"""Is the Hugging Face hub reachable? Asked before anything that would retry for half a minute offline.

Why: offline, ``from_pretrained`` of a hub id retries for about 28 s and ``datasets.load_dataset`` for
about 25 s before failing; a recipe step that does both on every rank wastes a minute to report a missing
network. A TCP connection to the endpoint, with a timeout, answers in seconds.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

__all__ = ["endpoint", "hub_reachable", "offline_mode"]

_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' / datasets' own flag) is set: only the local cache is used."""
    return any(
        os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds.

    Behind a proxy a direct connection proves nothing, so then the answer is yes and `datasets` decides. The
    connection runs in a daemon thread because name resolution ignores socket timeouts.
    """
    if any(os.environ.get(name) for name in _PROXY_VARS):
        return True
    url = urlparse(endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    opened: list[bool] = []

    def connect() -> None:
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout):
                opened.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout)
    return bool(opened)
