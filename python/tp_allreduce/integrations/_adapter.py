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

Size-independent mode (``size_independent=True``; vLLM under
``VLLM_BATCH_INVARIANT=1``, SGLang under deterministic inference): every
message size goes through algorithms whose per-element reduction order does
not depend on the size, so a row's result has the same bits whatever the
batch. The communicator is asked for it with ``batch_invariant=True`` where
the library offers that option; until then it is created with one forced
algorithm (``SIZE_INDEPENDENT_FALLBACK``) and fused calls run unfused.

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
# Forced for every call in size-independent mode while the library has no
# `batch_invariant` option: one algorithm for every size cannot depend on it.
SIZE_INDEPENDENT_FALLBACK = "one-shot-push"
# What the library reports from `plan()` for the algorithms whose reduction
# order is the same at every size (ranks summed in rank order in f32).
SIZE_INDEPENDENT_ALGORITHMS = ("one-shot-push", "two-shot-push", "one-shot-pull", "two-shot-pull")
# The algorithm name the communicator's plans give NCCL's path: where a call
# would run it, the adapter declines and the engine's own path runs (the
# library's NCCL communicator is no faster than the engine's).
NCCL = "nccl"
# Plans remembered per adapter before the memory starts over (an engine
# calls a few hundred distinct shapes).
PLAN_CACHE_ENTRIES = 4096


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

    def make_communicator(self, group, device, capture_copy_bytes, size_independent=False):
        """The communicator, and in size-independent mode whether the
        library itself guarantees it (``batch_invariant=True``) rather than
        the forced-algorithm fallback. Returns ``comm`` (the flag is stored
        on it as ``_tpa_native_batch_invariant``)."""
        import inspect

        from ..torch import Communicator

        kwargs = {"capture_copy_bytes": capture_copy_bytes}
        native = False
        if size_independent:
            if "batch_invariant" in inspect.signature(Communicator.from_group).parameters:
                kwargs["batch_invariant"] = True
                native = True
            else:
                kwargs["algorithm"] = SIZE_INDEPENDENT_FALLBACK
        comm = Communicator.from_group(group, device, **kwargs)
        comm._tpa_native_batch_invariant = native
        return comm

    def nbytes(self, inp):
        return inp.numel() * inp.element_size()

    def dtype(self, inp):
        return inp.dtype

    def capturing(self):
        """Whether the current stream is capturing a CUDA graph."""
        return self.torch.cuda.is_current_stream_capturing()

    def compiling(self):
        """Whether torch.compile is tracing this call."""
        compiler = getattr(self.torch, "compiler", None)
        is_compiling = getattr(compiler, "is_compiling", None)
        return bool(is_compiling()) if is_compiling is not None else False

    def fused_shape(self, inp, weight):
        """``(rows, hidden)`` of a fused call that passed ``fused_ineligible``."""
        hidden = weight.numel()
        return inp.numel() // hidden, hidden

    def clone(self, t):
        return t.clone()

    def rows(self, inp):
        return inp.shape[0] if inp.dim() > 0 else 1

    def rows_view(self, out, inp, mul, div):
        """``out`` (a collective's result) viewed with ``inp``'s trailing
        shape and ``rows(inp) * mul // div`` rows."""
        shape = (self.rows(inp) * mul // div, *inp.shape[1:])
        return out if tuple(out.shape) == shape else out.view(shape)

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


# Per path, the calls the engine made of an enabled adapter in this process
# (``counters()``): "ours" (allreduces tp-allreduce ran), "declined" (the
# engine asked, tp-allreduce refused: the engine's own path ran), "fused"
# (fused allreduce + residual + RMSNorm calls tp-allreduce ran),
# "fused_declined", "all_gather", "reduce_scatter". Counted where the Python
# call happens: eager calls and calls captured into a CUDA graph (a replay
# re-runs the captured kernels without Python and is not counted).
COUNTER_KEYS = ("ours", "declined", "fused", "fused_declined", "all_gather", "reduce_scatter")
_adapters = []  # weak references to every adapter of this process


def counters():
    """Calls per path summed over this process's enabled adapters (see
    ``COUNTER_KEYS``), plus ``"groups"``: how many adapters are enabled."""
    import weakref  # noqa: F401 (the references are made in __init__)

    total = dict.fromkeys(COUNTER_KEYS, 0)
    total["groups"] = 0
    for ref in list(_adapters):
        ca = ref()
        if ca is None or ca.disabled:
            continue
        total["groups"] += 1
        for k in COUNTER_KEYS:
            total[k] += ca.counters[k]
    return total


class CustomAllreduceAdapter:
    """An engine's ``CustomAllreduce`` surface backed by tp-allreduce.
    ``counters``: this adapter's calls per path (``COUNTER_KEYS``)."""

    engine = "engine"

    def __init__(
        self, group, device, max_size=DEFAULT_MAX_SIZE, *, runtime=None, size_independent=False, **_engine_options
    ):
        import weakref

        self._IS_CAPTURING = False
        self.counters = dict.fromkeys(COUNTER_KEYS, 0)
        _adapters.append(weakref.ref(self))
        self.size_independent = bool(size_independent)
        # The engines toggle `disabled` in place (piecewise graphs) and
        # restore it from `original_disabled`.
        self.disabled = True
        self.original_disabled = True
        self.disabled_reason = None
        self.group = group
        self.device = device
        self.max_size = int(max_size)
        self.comm = None
        # (what, bytes or shape, dtype, capturing) -> whether the plan is NCCL's.
        self._nccl_plans = {}
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
            extra = {"size_independent": True} if self.size_independent else {}
            self.comm = rt.make_communicator(self.group, self.device, capture_copy_bytes=self.max_size, **extra)
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
                "tp-allreduce replaces %s's custom allreduce for a group of %d ranks (%s)",
                self.engine,
                self.world_size,
                "every size, size-independent algorithms"
                if self.size_independent
                else f"messages < {self.max_size} bytes",
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
        """Whether ``inp`` goes through tp-allreduce (the engine's gate; a
        refusal is counted as ``declined``). Below ``max_size`` bytes, and
        not where the communicator's plan for the size is NCCL's (the
        engine's own path then runs); in size-independent mode every size
        (the engine's fallback would not be size-independent; the library
        chunks long messages)."""
        ok = self._eligible(inp)
        if not ok and not self.disabled:
            self.counters["declined"] += 1
        return ok

    def _eligible(self, inp, nccl_check=True) -> bool:
        if self.disabled or self.comm is None:
            return False
        if not self.size_independent and self._runtime.nbytes(inp) >= self.max_size:
            return False
        if self._runtime.ineligible(inp, self.device) is not None:
            return False
        return not (nccl_check and self._plan_is_nccl("allreduce", self._runtime.nbytes(inp), inp))

    def _plan_is_nccl(self, what, size, inp):
        """Whether the communicator would run NCCL's path for this call
        (``what``: ``"allreduce"`` of ``size`` bytes, ``"fused"`` of ``size
        = (rows, hidden)``, ``"all-gather"`` / ``"reduce-scatter"`` of
        ``size`` bytes a rank): then the engine's own path is at least as
        fast, and the adapter declines. Never in size-independent mode (the
        engine's path would not be size-independent). The plan is fixed once
        the communicator is built (measured ``auto`` runs at construction,
        rank 0's table on every rank), so the answer is remembered per
        (what, size, dtype, capturing) and is the same on every rank."""
        if self.size_independent:
            return False
        rt = self._runtime
        if rt.compiling():
            # Traced by torch.compile: the answer would be baked into the
            # compiled graph for eager calls and graph replays alike, and
            # asking the CUDA runtime whether a stream captures breaks the
            # trace. Take the call: every size is correct through
            # tp-allreduce (NCCL's sizes through its own NCCL), on every rank.
            return False
        dtype = rt.dtype(inp)
        key = (what, size, dtype, bool(rt.capturing()))
        known = self._nccl_plans.get(key)
        if known is None:
            known = self._ask_plan(what, size, dtype, key[3]) == NCCL
            if len(self._nccl_plans) >= PLAN_CACHE_ENTRIES:
                self._nccl_plans.clear()
            self._nccl_plans[key] = known
        return known

    def _ask_plan(self, what, size, dtype, capturing):
        """The algorithm name of the communicator's plan, or ``None`` where
        it has no such plan (the call is then taken, as before plans)."""
        comm = self.comm
        try:
            if what == "allreduce":
                plan = getattr(comm, "plan", None)
                return None if plan is None else plan(size, dtype, capturing)[0]
            if what == "fused":
                plan = getattr(comm, "plan_fused", None)
                return None if plan is None else plan(size[0], size[1], dtype, capturing)[0]
            plan = getattr(comm, "plan_collective", None)
            return None if plan is None else plan(what, size, capturing)[0]
        except Exception as e:  # a plan is advice: never take the engine down
            logger.warning("tp-allreduce: %s plan for %s failed (%s); taking the call", what, size, e)
            return None

    @property
    def fused_runs_unfused(self) -> bool:
        """Size-independent mode without the library's guarantee: fused
        calls run the allreduce, then the separate kernel, whatever the shape
        (the fused kernel's choice depends on the shape)."""
        return self.size_independent and not getattr(self.comm, "_tpa_native_batch_invariant", False)

    def custom_all_reduce(self, input):  # noqa: A002 (the engines' parameter name)
        """Out-of-place sum over the group, or ``None`` when this call is not
        for us. Correct in every phase: eager, warm-up inside ``capture()``
        and inside a graph being captured."""
        if self.disabled or not self._eligible(input):
            return None
        self.counters["ours"] += 1
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
        us (disabled, too large, other dtypes or shapes, a shape whose fused
        plan is NCCL's): the engine then
        runs its allreduce and RMSNorm itself. The decision depends only on
        shapes and dtypes, so it is the same on every rank."""
        if self.disabled:
            return None
        rt = self._runtime
        if (
            not self._eligible(input, nccl_check=False)
            or rt.fused_ineligible(input, residual, weight) is not None
            or self._plan_is_nccl("fused", rt.fused_shape(input, weight), input)
        ):
            self.counters["fused_declined"] += 1
            return None
        self.counters["fused"] += 1
        if self.fused_runs_unfused:
            return self.comm.all_reduce_add_rms_norm(input, residual, weight, eps, unfused=True)
        return self.comm.all_reduce_add_rms_norm(input, residual, weight, eps)

    # ------------------------------------------------------------ all-gather / reduce-scatter
    # tp-allreduce's all-gather and reduce-scatter are reached only when the
    # Python Communicator has them (``all_gather(x) -> tensor``,
    # ``reduce_scatter(x) -> tensor``, the conventions of ``all_reduce``:
    # rows of dimension 0 in rank order). Without them these return None /
    # False and the engine takes its own path.
    def has_all_gather(self) -> bool:
        return not self.disabled and self.comm is not None and hasattr(self.comm, "all_gather")

    def has_reduce_scatter(self) -> bool:
        return not self.disabled and self.comm is not None and hasattr(self.comm, "reduce_scatter")

    def _collective_ineligible(self, inp):
        if self._runtime.ineligible(inp, self.device) is not None:
            return True
        nbytes = self._runtime.nbytes(inp)
        return nbytes == 0 or nbytes % 16 != 0

    def gather_eligible(self, inp) -> bool:
        """Whether ``gather_rows(inp)`` is for us: a float tensor of whole
        16-byte words, the gathered result within ``max_size`` (any size in
        size-independent mode), and not a size the communicator's plan
        gives NCCL's ring (the engine's own all-gather then runs)."""
        if not self.has_all_gather() or self._collective_ineligible(inp):
            return False
        nbytes = self._runtime.nbytes(inp)
        if nbytes * self.world_size > self.max_size and not self.size_independent:
            return False
        return not self._plan_is_nccl("all-gather", nbytes, inp)

    def gather_rows(self, inp):
        """``inp`` of every rank stacked along dimension 0 in rank order
        (shape ``(world * n, ...)``), or None when not for us
        (``gather_eligible``)."""
        if not self.gather_eligible(inp):
            return None
        self.counters["all_gather"] += 1
        return self._runtime.rows_view(self.comm.all_gather(inp), inp, self.world_size, 1)

    def scatter_eligible(self, inp) -> bool:
        """Whether ``scatter_rows(inp)`` is for us: rows divisible by the
        world size, a share of whole 16-byte words, at most ``max_size``
        bytes, and not a size the communicator's plan gives NCCL's ring."""
        if not self.has_reduce_scatter() or self._collective_ineligible(inp):
            return False
        rows = self._runtime.rows(inp)
        nbytes = self._runtime.nbytes(inp)
        if rows % self.world_size != 0 or (nbytes // self.world_size) % 16 != 0 or nbytes > self.max_size:
            return False
        return not self._plan_is_nccl("reduce-scatter", nbytes // self.world_size, inp)

    def scatter_rows(self, inp):
        """Rank r's share (rows ``r * n / world`` to ``(r + 1) * n / world``)
        of the sum over ranks, or None when not for us (``scatter_eligible``)."""
        if not self.scatter_eligible(inp):
            return None
        self.counters["reduce_scatter"] += 1
        return self._runtime.rows_view(self.comm.reduce_scatter(inp), inp, 1, self.world_size)

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
            logger.info("tp-allreduce: registered %d CUDA-graph inputs; calls so far %s", count, self.counters)
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
