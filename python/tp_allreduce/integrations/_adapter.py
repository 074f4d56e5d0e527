"""The custom-allreduce surface SGLang and vLLM call, over a tp-allreduce
communicator. The engine-specific modules subclass it.

The engines' contract (read from their sources):

* constructed as ``cls(group=<gloo CPU group>, device=cuda:N, ...)`` on every
  rank of a group; ``disabled`` / ``original_disabled`` say whether it is
  usable (the engine falls back to NCCL otherwise);
* ``should_custom_ar(inp)`` gates each call; ``custom_all_reduce(inp)``
  returns a new tensor (out of place) or ``None``;
* ``capture()`` wraps CUDA-graph capture; on exit the captured inputs are
  registered (collective);
* ``close()`` on shutdown.

Differences from the engines' own class, on purpose: no NVLink gate (PCIe
boxes of 2-8 GPUs are the point), and warm-up calls inside ``capture()``
but outside a graph return the real sum instead of an uninitialised tensor.

PyTorch is reached only through a *runtime* object (``TorchRuntime``), so
the logic here is tested with fakes on machines without torch or a GPU.
"""

import contextlib
import logging
import socket

logger = logging.getLogger("tp_allreduce")

DEFAULT_MAX_SIZE = 8192 * 1024


class TorchRuntime:
    """What the adapter needs from PyTorch and torch.distributed."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist

    def rank_and_world(self, group):
        return self.dist.get_rank(group), self.dist.get_world_size(group)

    def gather_object(self, group, obj):
        """Every rank's ``obj`` in group-rank order. Built from
        ``broadcast_object_list`` because ``all_gather_object`` fails on gloo
        groups under inference mode (pytorch/pytorch#126032)."""
        from ..torch import _global_rank

        world = self.dist.get_world_size(group)
        me = self.dist.get_rank(group)
        out = []
        for r in range(world):
            box = [obj if r == me else None]
            self.dist.broadcast_object_list(box, src=_global_rank(group, r), group=group)
            out.append(box[0])
        return out

    def hostname(self):
        return socket.gethostname()

    def normalize_device(self, device):
        from ..torch import normalize_device

        return normalize_device(device)

    def make_communicator(self, group, device, capture_copy_bytes):
        from ..torch import Communicator

        return Communicator.from_group(group, device, capture_copy_bytes=capture_copy_bytes)

    def nbytes(self, inp):
        return inp.numel() * inp.element_size()

    def fused_ineligible(self, inp, residual, weight):
        """Why ``(inp, residual, weight)`` cannot take the fused call, or
        ``None`` (``inp`` already passed ``ineligible``)."""
        torch = self.torch
        if not isinstance(residual, torch.Tensor) or not isinstance(weight, torch.Tensor):
            return "residual or weight is not a tensor"
        if residual.dtype != inp.dtype or weight.dtype != inp.dtype:
            return f"dtypes differ: input {inp.dtype}, residual {residual.dtype}, weight {weight.dtype}"
        if residual.device != inp.device or weight.device != inp.device:
            return "residual or weight on another device"
        if not residual.is_contiguous() or not weight.is_contiguous():
            return "residual or weight not contiguous"
        hidden = weight.numel()
        if weight.dim() != 1 or hidden == 0 or inp.numel() % hidden != 0 or residual.numel() != inp.numel():
            return "shapes do not match rows x weight.numel()"
        return None

    def ineligible(self, inp, device):
        """Why ``inp`` cannot go through tp-allreduce, or ``None``."""
        from .. import dtypes
        from ..errors import Unsupported

        if not isinstance(inp, self.torch.Tensor) or inp.device != device:
            return "not a tensor on the communicator's device"
        if not inp.is_contiguous():
            return "not contiguous"
        try:
            dtypes.code_of(inp.dtype)
        except Unsupported:
            return f"dtype {inp.dtype}"
        return None


class CustomAllreduceAdapter:
    """An engine's ``CustomAllreduce`` surface backed by tp-allreduce."""

    engine = "engine"

    def __init__(self, group, device, max_size=DEFAULT_MAX_SIZE, *, runtime=None, **_engine_options):
        self._IS_CAPTURING = False
        # The engines toggle `disabled` in place (piecewise graphs) and
        # restore it from `original_disabled`.
        self.disabled = True
        self.original_disabled = True
        self.disabled_reason = None
        self.group = group
        self.device = device
        self.max_size = int(max_size)
        self.comm = None
        self.rank = 0
        self.world_size = 1
        try:
            self._runtime = runtime if runtime is not None else TorchRuntime()
            self.rank, self.world_size = self._runtime.rank_and_world(group)
        except Exception as e:
            self._disable(f"cannot read the process group: {type(e).__name__}: {e}")
            return
        if self.world_size == 1:
            self._disable("world size 1: nothing to reduce")
            return
        try:
            self._start()
        except Exception as e:  # the group itself failed: never take the engine down
            self._close_comm()
            self._disable(f"setup failed: {type(e).__name__}: {e}")

    def _start(self):
        """Collective: same host, communicator on every rank, or disabled on every rank."""
        rt = self._runtime
        hosts = rt.gather_object(self.group, rt.hostname())
        if len(set(hosts)) != 1:
            self._disable(f"the group spans hosts {sorted(set(hosts))}; tp-allreduce works within one host")
            return
        why = None
        try:
            self.device = rt.normalize_device(self.device)
            self.comm = rt.make_communicator(self.group, self.device, capture_copy_bytes=self.max_size)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        outcomes = rt.gather_object(self.group, why)
        failed = [f"rank {r}: {w}" for r, w in enumerate(outcomes) if w is not None]
        if failed:
            self._close_comm()
            self._disable("communicator setup failed (" + "; ".join(failed) + ")")
            return
        self.disabled = False
        self.original_disabled = False
        if self.rank == 0:
            logger.info(
                "tp-allreduce replaces %s's custom allreduce for a group of %d ranks (messages < %d bytes)",
                self.engine,
                self.world_size,
                self.max_size,
            )

    def _disable(self, why):
        self.disabled = True
        self.original_disabled = True
        self.disabled_reason = why
        if self.world_size > 1:
            logger.warning("tp-allreduce disabled for this group, %s falls back to its default: %s", self.engine, why)

    def _close_comm(self):
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.close()
            except Exception as e:
                logger.warning("tp-allreduce: closing the communicator failed: %s", e)

    # ------------------------------------------------------------ calls
    def should_custom_ar(self, inp) -> bool:
        if self.disabled or self.comm is None:
            return False
        if self._runtime.nbytes(inp) >= self.max_size:
            return False
        return self._runtime.ineligible(inp, self.device) is None

    def custom_all_reduce(self, input):  # noqa: A002 (the engines' parameter name)
        """Out-of-place sum over the group, or ``None`` when this call is not
        for us. Correct in every phase: eager, warm-up inside ``capture()``
        and inside a graph being captured."""
        if self.disabled or not self.should_custom_ar(input):
            return None
        return self.comm.all_reduce(input)

    def all_reduce(self, inp, *, out=None, registered=False):
        """Out-of-place sum into ``out`` (engines' helper signature;
        ``registered`` is ignored: the communicator decides)."""
        return self.comm.all_reduce(inp, out=out)

    def fused_allreduce_rmsnorm(self, input, residual, weight, eps):  # noqa: A002
        """The engine's fused hook: the sum of ``input`` over the group plus
        ``residual``, then RMSNorm with ``weight``, in one call (fused into
        the allreduce kernel where tp-allreduce picks one-shot push or pull,
        else the allreduce followed by a separate kernel). Returns
        ``(normed, residual)``: ``residual`` updated in place to sum +
        residual, ``normed`` a new tensor. ``None`` when this call is not for
        us (disabled, too large, other dtypes or shapes): the engine then
        runs its allreduce and RMSNorm itself. The decision depends only on
        shapes and dtypes, so it is the same on every rank."""
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._runtime.fused_ineligible(input, residual, weight) is not None:
            return None
        return self.comm.all_reduce_add_rms_norm(input, residual, weight, eps)

    # ------------------------------------------------------------ graphs
    @contextlib.contextmanager
    def capture(self):
        """Wraps CUDA-graph capture; on a normal exit registers the captured
        inputs on every rank (collective). Registration runs whenever the
        communicator is open, even if ``disabled`` was toggled meanwhile, so
        calls captured while enabled are always registered."""
        self._IS_CAPTURING = True
        try:
            yield
        finally:
            self._IS_CAPTURING = False
        if self.comm is not None:
            self.register_graph_buffers()

    def register_graph_buffers(self):
        count = self.comm.register_graph_buffers()
        if self.rank == 0:
            logger.info("tp-allreduce: registered %d CUDA-graph inputs", count)
        return count

    def finalize_p2p(self):
        """vLLM calls this after setup; nothing is left to do here."""

    # ------------------------------------------------------------ lifecycle
    def close(self):
        self._close_comm()
        self.disabled = True

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
