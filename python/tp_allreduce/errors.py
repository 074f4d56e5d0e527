"""Exceptions raised by tp-allreduce. Each carries the library's message,
which names what failed and what to do about it.

    TpAllreduceError
    ├── InvalidUsage (also a ValueError)       an API rule was broken
    ├── Unsupported                            valid, but not implemented here (e.g. a dtype)
    ├── TimeoutError (also the built-in TimeoutError)
    │   ├── DeviceTimeout                      a kernel's bounded wait on a peer gave up
    │   └── RendezvousTimeout (also a RendezvousError)
    ├── PeerAborted                            a peer rank failed first
    ├── DeviceError                            a kernel refused to run
    ├── CommunicatorBroken                     an earlier error broke the communicator
    ├── RendezvousError                        joining or exchanging with the other ranks failed
    ├── IpcError                               CUDA IPC export/import failed
    ├── P2pCheckError                          the init-time peer transfer check failed
    ├── DriverError                            a CUDA driver call failed
    │   └── NoDriverError                      no usable CUDA driver in this process
    ├── NcclError, ConfigError, IoError

After DeviceTimeout, PeerAborted, DeviceError or CommunicatorBroken the
communicator is unusable: create a new one.
"""

import builtins


class TpAllreduceError(Exception):
    """Base class of every tp-allreduce error."""


class InvalidUsage(TpAllreduceError, ValueError):
    """The caller broke an API rule (pointers, sizes, dtypes, devices, order)."""


class Unsupported(TpAllreduceError):
    """Valid, but this library does not implement it; the message names the alternative."""


class TimeoutError(TpAllreduceError, builtins.TimeoutError):  # noqa: A001 (deliberately ours)
    """A bounded wait gave up."""


class DeviceTimeout(TimeoutError):
    """A kernel's bounded wait on a peer gave up; the communicator is broken."""


class PeerAborted(TpAllreduceError):
    """A peer rank aborted after its own error; the communicator is broken."""


class DeviceError(TpAllreduceError):
    """A kernel refused to run; the communicator is broken."""


class CommunicatorBroken(TpAllreduceError):
    """An earlier error broke the communicator; create a new one."""


class RendezvousError(TpAllreduceError):
    """Joining or exchanging data with the other ranks failed."""


class RendezvousTimeout(TimeoutError, RendezvousError):
    """A rendezvous step did not complete in time (a rank did not arrive)."""


class IpcError(TpAllreduceError):
    """CUDA IPC export or import failed."""


class P2pCheckError(TpAllreduceError):
    """The init-time P2P transfer check found corrupted data between two ranks."""


class DriverError(TpAllreduceError):
    """A CUDA driver call failed."""


class NoDriverError(DriverError):
    """No CUDA driver could be loaded (no NVIDIA driver or no GPU visible)."""


class NcclError(TpAllreduceError):
    """NCCL (the fallback) failed or is not available."""


class ConfigError(TpAllreduceError):
    """Configuration, topology or tuning-table problem (e.g. a bad TP_ALLREDUCE_* value)."""


class IoError(TpAllreduceError):
    """An operating-system call failed (sockets, files)."""


__all__ = [
    "TpAllreduceError",
    "InvalidUsage",
    "Unsupported",
    "TimeoutError",
    "DeviceTimeout",
    "PeerAborted",
    "DeviceError",
    "CommunicatorBroken",
    "RendezvousError",
    "RendezvousTimeout",
    "IpcError",
    "P2pCheckError",
    "DriverError",
    "NoDriverError",
    "NcclError",
    "ConfigError",
    "IoError",
]
