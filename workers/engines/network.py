"""The address peers reach this host at, for engines that advertise a port (KV-transfer bootstrap servers)."""

from __future__ import annotations

import os
import socket


def advertised_host(bind_host: str) -> str:
    """What to tell peers for a server bound to `bind_host`: itself, unless it binds every address (0.0.0.0, ::),
    then this host's own address on the network peers reach (SGLANG_HOST_IP wins, as in SGLang)."""
    if bind_host not in ("0.0.0.0", "::"):
        return bind_host
    if os.environ.get("SGLANG_HOST_IP"):
        return os.environ["SGLANG_HOST_IP"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
