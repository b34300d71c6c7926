"""Which processes share a machine, as far as looking up a process id can tell.

[Note: telling hosts apart]
Two things ask "is that rank on this host?": the diagnosis of a lost peer (it looks the peer's process id up in
``/proc``) and the disk tier's scratch clean-up (it removes a directory whose process is gone). A hostname alone
answers wrongly twice: nodes of a cluster can share one (containers given the same name), and containers that share
the machine's hostname (``--network host``) each have their own process-id namespace, where a live job's pid is
simply absent, so one container deleted another's live scratch files. A process id means something only within its
machine's boot and its pid namespace, so the identity is the hostname, the kernel's boot id and the pid namespace's
inode together.
"""

from __future__ import annotations

import functools
import os
import socket
import zlib


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """``hostname/boot id/pid namespace``: equal exactly for processes whose pids can see each other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "?"
    return f"{socket.gethostname()}/{boot}/{pidns}"


def host_number() -> int:
    """``host_identity`` as a non-negative int64 (for one fixed-size all-gather)."""
    return zlib.crc32(host_identity().encode()) & 0x7FFFFFFF
