"""Where hivemind runs: the platforms it ships wheels for, and the one line a volunteer elsewhere reads first.

hivemind 1.1.12 has wheels (with its p2pd daemon inside) for Linux x86_64/aarch64 and macOS x86_64/arm64 only.
On Windows pip would fall back to its sdist, which fails to build, so ``pyproject.toml`` installs hivemind only on
:data:`HIVEMIND_WHEEL_PLATFORMS` (an environment marker) and ``import lightning_swarm`` says, in one line, what to
do instead. Upstream calls macOS "partially supported": one warning line there too.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from typing import Optional, Tuple

WSL_URL = "https://learn.microsoft.com/windows/wsl/install"
HIVEMIND_MACOS_NOTE = "https://github.com/learning-at-home/hivemind#installation"
# (sys.platform, platform.machine()) pairs hivemind 1.1.12 has wheels for; pyproject.toml's marker says the same
HIVEMIND_WHEEL_PLATFORMS = (("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "x86_64"), ("darwin", "arm64"))

log = logging.getLogger("lightning_swarm")
# set once the line is shown: child processes (spawned ones re-import the package, as on macOS) stay quiet
NOTICE_SHOWN_ENV = "LIGHTNING_SWARM_PLATFORM_NOTICE_SHOWN"


def platform_notice(system: Optional[str] = None, machine: Optional[str] = None) -> Optional[Tuple[int, str]]:
    """(logging level, one line) for a platform where hivemind does not fully work, or None where it does.

    Args:
        system: ``sys.platform`` of the machine (default: this one's).
        machine: ``platform.machine()`` of the machine (default: this one's).
    """
    system = sys.platform if system is None else system
    machine = platform.machine() if machine is None else machine
    if system.startswith(("win32", "cygwin", "msys")):
        return logging.ERROR, ("[lightning_swarm] Windows: hivemind (the swarm's networking) does not run on Windows; "
                               f"install and train inside WSL2 (Ubuntu), see {WSL_URL}")
    if system == "darwin":
        return logging.WARNING, ("[lightning_swarm] macOS: hivemind calls macOS partially supported "
                                 f"({HIVEMIND_MACOS_NOTE}); if the swarm misbehaves here, a Linux machine is the fix")
    if (system, machine.lower()) not in HIVEMIND_WHEEL_PLATFORMS and system.startswith("linux"):
        return logging.ERROR, (f"[lightning_swarm] {system}/{machine}: hivemind ships wheels for Linux x86_64 and "
                               "aarch64 only, so it is not installed here; use an x86_64 or aarch64 machine")
    return None


def warn_about_platform() -> None:
    """Log :func:`platform_notice`'s line once per process tree (Python's last-resort handler prints it alone on
    stderr when logging is not configured)."""
    if os.environ.get(NOTICE_SHOWN_ENV):
        return
    notice = platform_notice()
    if notice is not None:
        log.log(*notice)
        os.environ[NOTICE_SHOWN_ENV] = "1"
