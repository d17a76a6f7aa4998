"""What processor this is, read from /proc/cpuinfo: for records of where something was measured."""

from __future__ import annotations

import platform


def cpuinfo_field(name: str) -> str | None:
    """The first value of a /proc/cpuinfo field (Linux), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The processor's model name, for records of where something was measured."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()
