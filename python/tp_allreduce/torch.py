"""The PyTorch API.

    import torch.distributed as dist
    from tp_allreduce.torch import Communicator

    comm = Communicator.from_group(gloo_group, torch.device("cuda", local_rank))
    y = comm.all_reduce(x)            # out of place (or out=...)
    comm.all_reduce_(x)               # in place
    normed, residual = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-6)  # + residual, RMSNorm
    with comm.capture():              # registers graph inputs on exit
        with torch.cuda.graph(g):
            y = comm.all_reduce(x)
    g.replay()

Calls are queued on PyTorch's current stream of the tensor's device, may be
captured in CUDA graphs, release the GIL while they block and leave the
current device as they found it. Every rank must issue the same calls
(sizes, dtypes, order), like any collective.

Memory from ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` works:
eager calls never need registration, and a captured call whose input CUDA
IPC cannot export is captured as a copy into a buffer the communicator
registered at creation (``capture_copy_bytes``; see ``tp_allreduce._core``).
"""

import contextlib
import itertools
import weakref

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise
    raise ModuleNotFoundError(
        "tp_allreduce.torch needs PyTorch, which is not installed: install the package with its `torch` extra "
        "(`pip install './python[torch]'` from a checkout, `pip install 'tp_allreduce-<version>.whl[torch]'` "
        "from a wheel) or install torch; the raw API (`import tp_allreduce`) needs no PyTorch",
        name="torch",
    ) from missing

from . import _core, dtypes
from .errors import InvalidUsage, RendezvousError

__all__ = ["Communicator", "normalize_device", "is_ipc_exportable"]

# ---------------------------------------------------------------- torch.compile
# Under torch.compile the collectives below (when they allocate their
# output) go through torch custom ops, ``torch.ops.tp_allreduce.*``, whose
# fake implementations only describe the output (no native call), so a
# compiled graph holds them without a graph break; the real implementation
# is the eager method. Eager calls never pass through the dispatcher.
# Ops cannot take Python objects: the communicator is named by an integer
# (``Communicator._op_id``).
_communicators = {}  # op id -> weakref to a Communicator
_op_ids = itertools.count(1)
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
HAVE_CUSTOM_OPS = hasattr(torch, "library") and hasattr(torch.library, "custom_op")


def _by_id(op_id: int) -> "Communicator":
    comm = _communicators.get(op_id)
    comm = comm() if comm is not None else None
    if comm is None:
        raise InvalidUsage(f"tp_allreduce op called for communicator {op_id}, which no longer exists")
    return comm


if HAVE_CUSTOM_OPS:

    @torch.library.custom_op("tp_allreduce::all_reduce", mutates_args=())
    def _op_all_reduce(tensor: torch.Tensor, comm_id: int) -> torch.Tensor:
        return _by_id(comm_id).all_reduce(tensor)

    @_op_all_reduce.register_fake
    def _(tensor, comm_id):
        return torch.empty_like(tensor)

    @torch.library.custom_op("tp_allreduce::all_reduce_add_rms_norm", mutates_args=("residual",))
    def _op_all_reduce_add_rms_norm(
        input: torch.Tensor,  # noqa: A002
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        comm_id: int,
        weight_offset: bool,
        unfused: bool,
    ) -> torch.Tensor:
        out, _ = _by_id(comm_id).all_reduce_add_rms_norm(
            input, residual, weight, eps, weight_offset=weight_offset, unfused=unfused
        )
        return out

    @_op_all_reduce_add_rms_norm.register_fake
    def _(input, residual, weight, eps, comm_id, weight_offset, unfused):  # noqa: A002
        return torch.empty_like(input)

    @torch.library.custom_op("tp_allreduce::all_gather", mutates_args=())
    def _op_all_gather(tensor: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
        return _by_id(comm_id).all_gather(tensor)

    @_op_all_gather.register_fake
    def _(tensor, comm_id, world_size):
        shape = (world_size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() > 0 else (world_size,)
        return tensor.new_empty(shape)

    @torch.library.custom_op("tp_allreduce::reduce_scatter", mutates_args=())
    def _op_reduce_scatter(tensor: torch.Tensor, comm_id: int, world_size: int) -> torch.Tensor:
        return _by_id(comm_id).reduce_scatter(tensor)

    @_op_reduce_scatter.register_fake
    def _(tensor, comm_id, world_size):
        return tensor.new_empty((tensor.shape[0] // world_size, *tensor.shape[1:]))


def _compiled() -> bool:
    """True while torch.compile traces (then the custom ops are used)."""
    return HAVE_CUSTOM_OPS and _is_compiling()


def normalize_device(device) -> torch.device:
    """``cuda:N`` as a ``torch.device`` from an int, a string or a device;
    ``None`` or ``"cuda"`` mean the current CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise InvalidUsage(f"tp-allreduce runs on CUDA devices, got {device}")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_ipc_exportable(tensor: torch.Tensor) -> bool:
    """Whether CUDA IPC can export ``tensor``'s memory (False under
    ``expandable_segments:True``)."""
    return _core.pointer_is_ipc_exportable(tensor.data_ptr())


def _global_rank(group, group_rank: int) -> int:
    get = getattr(dist, "get_global_rank", None)
    if get is not None:
        return get(group, group_rank)
    return dist.get_process_group_ranks(group)[group_rank]


def _gather_object(group, obj) -> list:
    """Every rank's ``obj`` in group-rank order (collective). Built from
    ``broadcast_object_list``: ``all_gather_object`` fails on gloo groups
    under inference mode (pytorch/pytorch#126032)."""
    me = dist.get_rank(group)
    out = []
    for r in range(dist.get_world_size(group)):
        box = [obj if r == me else None]
        dist.broadcast_object_list(box, src=_global_rank(group, r), group=group)
        out.append(box[0])
    return out


class Communicator:
    """One rank of a tp-allreduce communicator on one CUDA device."""

    def __init__(self, core: "_core.Communicator", device: torch.device):
        self._core = core
        self.device = device
        self._op_id = next(_op_ids)
        self._op_world = int(core.world_size)  # a plain int: torch.compile reads it while tracing
        _communicators[self._op_id] = weakref.ref(self)

    @classmethod
    def from_group(
        cls,
        group=None,
        device=None,
        *,
        algorithm=None,
        capture_copy_bytes: int = _core.DEFAULT_CAPTURE_COPY_BYTES,
        batch_invariant: bool = False,
    ) -> "Communicator":
        """Collective over ``group`` (a ``torch.distributed`` process group,
        typically gloo: only small messages cross it): rank 0 creates the
        rendezvous id and broadcasts it, every rank sets itself up on
        ``device`` (driver, device, configuration), the ranks exchange how
        that went, and only if it went well everywhere do they join. A rank
        that fails raises its own error; the others raise
        ``RendezvousError`` naming it, at once (nobody waits in the
        rendezvous for a rank that already failed). Rank 0 removes the
        rendezvous id's directory on every failure. The ranks must be
        processes of one host. ``batch_invariant``: results that do not
        depend on the message size or the batch shape (the size-independent
        algorithms only; also ``TP_ALLREDUCE_BATCH_INVARIANT=1``)."""
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        device = normalize_device(device)
        made = None  # rank 0's id, whose directory it removes if anything fails
        try:
            box = [None]
            if rank == 0:
                try:
                    made = _core.Id.new_unix()
                    box[0] = ("id", str(made))
                except Exception as e:  # every rank must learn it, or they wait forever
                    box[0] = ("error", f"{type(e).__name__}: {e}")
            dist.broadcast_object_list(box, src=_global_rank(group, 0), group=group)
            kind, value = box[0]
            if kind != "id":
                raise RendezvousError(f"rank 0 could not create the rendezvous id: {value}")
            prepared, own, why = None, None, None
            try:
                prepared = _core.PreparedRank(device.index, algorithm=algorithm, batch_invariant=batch_invariant)
            except Exception as e:  # told to the others before raising
                own, why = e, f"{type(e).__name__}: {e}"
            failed = [(r, w) for r, w in enumerate(_gather_object(group, why)) if w is not None]
            if own is not None:
                raise own
            if failed:
                listed = "; ".join(f"rank {r}: {w}" for r, w in failed)
                raise RendezvousError(f"not joining: other ranks failed to set up before the rendezvous ({listed})")
            core = prepared.join(rank, world, value, capture_copy_bytes=capture_copy_bytes)
        except BaseException:
            if made is not None:
                made.remove_files()
            raise
        return cls(core, device)

    # ------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def core(self) -> "_core.Communicator":
        """The raw-pointer communicator underneath."""
        return self._core

    @property
    def closed(self) -> bool:
        return self._core.closed

    # ------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
        """Sum of ``tensor`` over the ranks, into ``out`` (a new tensor when
        ``None``); returns ``out``."""
        if out is None and _compiled():
            return torch.ops.tp_allreduce.all_reduce(tensor, self._op_id)
        code = self._check(tensor, "tensor")
        if out is None:
            out = torch.empty_like(tensor)
        else:
            self._check(out, "out")
            if out.dtype != tensor.dtype or out.numel() != tensor.numel():
                got, want = f"{out.dtype} x {out.numel()}", f"{tensor.dtype} x {tensor.numel()}"
                raise InvalidUsage(f"out must match the input: got {got}, input {want}")
        self._launch(tensor, out, code)
        return out

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum of ``tensor`` over the ranks; returns ``tensor``."""
        code = self._check(tensor, "tensor")
        self._launch(tensor, tensor, code)
        return tensor

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dimension 0, rank r's
        at rows ``[r*n, (r+1)*n)`` (``n = tensor.shape[0]``), into ``out`` (a
        new tensor of shape ``(world_size * n, *tensor.shape[1:])`` when
        ``None``); returns ``out``. Graph-capturable; needs no registration."""
        if out is None and _compiled():
            return torch.ops.tp_allreduce.all_gather(tensor, self._op_id, self._op_world)
        code = self._check(tensor, "tensor")
        shape = (self.world_size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() > 0 else (self.world_size,)
        if out is None:
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        else:
            self._check(out, "out")
            if out.dtype != tensor.dtype or out.numel() != self.world_size * tensor.numel():
                got, want = f"{out.dtype} x {out.numel()}", f"{tensor.dtype} x {self.world_size * tensor.numel()}"
                raise InvalidUsage(f"out must hold world_size x the input: got {got}, want {want}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._core.all_gather(tensor.data_ptr(), out.data_ptr(), tensor.numel(), code, stream)
        return out

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
        """The sum over ranks of rows ``[r*m, (r+1)*m)`` of ``tensor`` on rank
        ``r`` (``m = tensor.shape[0] / world_size``, which must divide), into
        ``out`` (a new tensor of shape ``(m, *tensor.shape[1:])`` when
        ``None``); returns ``out``. Graph-capturable; needs no registration."""
        if out is None and _compiled():
            return torch.ops.tp_allreduce.reduce_scatter(tensor, self._op_id, self._op_world)
        code = self._check(tensor, "tensor")
        if tensor.dim() == 0 or tensor.shape[0] % self.world_size != 0:
            raise InvalidUsage(f"reduce_scatter: dimension 0 of {tuple(tensor.shape)} is not a multiple of {self.world_size}")
        count = tensor.numel() // self.world_size
        if out is None:
            out = torch.empty((tensor.shape[0] // self.world_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        else:
            self._check(out, "out")
            if out.dtype != tensor.dtype or out.numel() != count:
                got, want = f"{out.dtype} x {out.numel()}", f"{tensor.dtype} x {count}"
                raise InvalidUsage(f"out must hold the input / world_size: got {got}, want {want}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._core.reduce_scatter(tensor.data_ptr(), out.data_ptr(), count, code, stream)
        return out

    def all_reduce_add_rms_norm(
        self,
        input: torch.Tensor,  # noqa: A002 (the engines' parameter name)
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor = None,
        weight_offset: bool = False,
        unfused: bool = False,
    ):
        """The transformer layer's epilogue in one call: the sum of ``input``
        over the ranks is added to ``residual`` (in place), then RMSNorm:
        ``out = residual * rsqrt(mean(residual**2) + eps) * weight`` (``1 +
        weight`` with ``weight_offset``, as Gemma). ``input`` holds rows of
        ``weight.numel()`` elements; ``residual`` and ``weight`` have its
        dtype and hold the same values on every rank. ``out`` may be
        ``input`` (in place), else a new tensor. Returns ``(out, residual)``.
        Fused into the allreduce kernel where the selection picks one-shot
        push or pull; ``unfused`` forces the allreduce, then the separate
        kernel."""
        if out is None and _compiled():
            normed = torch.ops.tp_allreduce.all_reduce_add_rms_norm(
                input, residual, weight, float(eps), self._op_id, weight_offset, unfused
            )
            return normed, residual
        code = self._check(input, "input")
        for t, what in ((residual, "residual"), (weight, "weight")):
            self._check(t, what)
            if t.dtype != input.dtype:
                raise InvalidUsage(f"{what} is {t.dtype}, but the input is {input.dtype}")
        hidden = weight.numel()
        if hidden == 0 or input.numel() % hidden != 0:
            raise InvalidUsage(f"the input's {input.numel()} elements are not rows of weight.numel() = {hidden}")
        if residual.numel() != input.numel():
            raise InvalidUsage(f"residual has {residual.numel()} elements, the input {input.numel()}")
        if out is None:
            out = torch.empty_like(input)
        else:
            self._check(out, "out")
            if out.dtype != input.dtype or out.numel() != input.numel():
                got, want = f"{out.dtype} x {out.numel()}", f"{input.dtype} x {input.numel()}"
                raise InvalidUsage(f"out must match the input: got {got}, input {want}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._core.all_reduce_add_rms_norm(
            input.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            input.numel() // hidden,
            hidden,
            float(eps),
            code,
            stream,
            weight_offset=weight_offset,
            unfused=unfused,
        )
        return out, residual

    def all_reduce_add_(self, input: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """``residual += sum of input over the ranks`` (rows of the last
        dimension); ``input`` is consumed (it may hold the sum afterwards).
        Returns ``residual``."""
        code = self._check(input, "input")
        self._check(residual, "residual")
        if residual.dtype != input.dtype or residual.numel() != input.numel():
            raise InvalidUsage(f"residual must match the input: {residual.dtype} x {residual.numel()}")
        hidden = input.shape[-1] if input.dim() > 0 else 1
        if hidden == 0:
            return residual
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._core.all_reduce_add(input.data_ptr(), residual.data_ptr(), input.numel() // hidden, hidden, code, stream)
        return residual

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, code: int) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._core.all_reduce(src.data_ptr(), dst.data_ptr(), src.numel(), code, stream)

    def _check(self, t, what: str) -> int:
        if not isinstance(t, torch.Tensor):
            raise InvalidUsage(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise InvalidUsage(f"{what} is on {t.device}, but this communicator runs on {self.device}")
        if not t.is_contiguous():
            raise InvalidUsage(f"{what} must be contiguous (call .contiguous() first)")
        return dtypes.code_of(t.dtype)

    # ------------------------------------------------------------ graphs
    @contextlib.contextmanager
    def capture(self):
        """Context for capturing CUDA graphs that contain allreduces: on a
        normal exit it registers their inputs (collective: every rank must
        capture the same calls). Graphs must not be replayed before."""
        yield self
        self.register_graph_buffers()

    def register_graph_buffers(self) -> int:
        """Collective, after capture: registers captured inputs; returns how many."""
        return self._core.register_graph_buffers()

    def deregister_buffers(self) -> int:
        """Collective: releases every registration (graphs captured before
        can no longer be replayed). Waits for all work on the device."""
        return self._core.deregister_buffers()

    def plan(self, nbytes: int, dtype=torch.bfloat16, capturing: bool = False):
        """``(algorithm, transport, reason)`` for a call of ``nbytes``."""
        return self._core.plan(nbytes, dtypes.code_of(dtype), capturing)

    def plan_fused(self, rows: int, hidden: int, dtype=torch.bfloat16, capturing: bool = False):
        """``(algorithm, transport, fused, reason)`` for a fused
        ``all_reduce_add_rms_norm`` of ``rows x hidden``."""
        return self._core.plan_fused(rows, hidden, dtypes.code_of(dtype), capturing)

    def plan_collective(self, collective: str, block_bytes: int, capturing: bool = False):
        """``(algorithm, reason)`` for an ``"all-gather"`` of ``block_bytes``
        a rank (its input) or a ``"reduce-scatter"`` of ``block_bytes`` a
        rank (its output); ``"nccl"`` where NCCL's ring runs."""
        return self._core.plan_collective(collective, block_bytes, capturing)

    # ------------------------------------------------------------ lifecycle
    def synchronize(self) -> None:
        """Waits for the current stream of the device; raises if a kernel
        recorded an error (timeout, peer abort)."""
        self._core.synchronize(torch.cuda.current_stream(self.device).cuda_stream)

    def check(self) -> None:
        """Raises if a kernel recorded an error (no synchronisation)."""
        self._core.check()

    def close(self) -> None:
        """Collective teardown: waits for the device, meets the other ranks
        and releases the communicator; raises what went wrong (a device
        error, a rank that did not arrive), the communicator being released
        either way. Call it on every rank; do not replay graphs captured
        with it afterwards."""
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return f"tp_allreduce.torch.Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device})"
