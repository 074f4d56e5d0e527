"""The vLLM side, written against whatever vLLM classes it is given (so
this module imports neither vLLM nor PyTorch and is tested with fakes).

tp-allreduce goes *into* vLLM's own ``CudaCommunicator``: ``install``
wraps the class's ``__init__`` (and ``destroy``) in place, so every
instance vLLM builds, through the platform or directly (the elastic-EP
``StatelessGroupCoordinator`` asserts ``device_comm_cls ==
CudaCommunicator`` and then calls the class itself), gets tp-allreduce as
its ``ca_comm`` where vLLM would build a custom allreduce (tensor-parallel
groups). The class stays vLLM's: no subclass, no isinstance or identity
check changes.

What vLLM reads from ``ca_comm`` (0.33.0 and 0.34.0 alike): ``disabled``,
``should_custom_ar``, ``custom_all_reduce``, ``capture`` (entered by
``graph_capture(device)``, and in 0.34.0 ``graph_capture(device, stream)``,
whose second window reuses the first one's stream),
``custom_all_gather``, ``custom_reduce_scatter`` (called without a guard by
``CudaCommunicator``; their callers fall back to NCCL on ``None``),
``fully_connected`` and ``mnnvl_lamport_ag_multicast_ptr`` (model code).
``mnnvl_only`` is read only inside vLLM's own class (0.34.0 gates its IPC
allreduce and graph registration on it): vLLM sets it on a group spanning
nodes, where tp-allreduce disables itself and leaves vLLM's own in place.
"""

import functools
import logging
import os

from .._adapter import DEFAULT_MAX_SIZE, CustomAllreduceAdapter

logger = logging.getLogger("tp_allreduce")

# TP_ALLREDUCE_VLLM_OVER_FLASHINFER=1: on tensor-parallel groups where
# tp-allreduce runs, vLLM's FlashInfer allreduces (on by default on sm90 and
# sm100, consulted before the custom allreduce) are dropped so that every
# eligible call reaches tp-allreduce, and the platform turns off the
# compile-time AR+RMSNorm fusion pass (FlashInfer's kernel) by default.
OVER_FLASHINFER_SWITCH = "TP_ALLREDUCE_VLLM_OVER_FLASHINFER"


def over_flashinfer() -> bool:
    return os.environ.get(OVER_FLASHINFER_SWITCH, "").strip() == "1"


def _env_flag(name) -> bool:
    """vLLM's parsing of its boolean variables (``"1"``/``"true"``)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def batch_invariant() -> bool:
    """``vllm.envs.VLLM_BATCH_INVARIANT`` where vLLM is importable, else
    the same parsing of the environment."""
    try:
        import vllm.envs as envs

        return bool(envs.VLLM_BATCH_INVARIANT)
    except Exception:
        return _env_flag("VLLM_BATCH_INVARIANT")


class TpAllreduceVllmCustomAllreduce(CustomAllreduceAdapter):
    """vLLM's ``CustomAllreduce`` surface (``group, device, max_size``;
    vLLM-only keyword arguments such as ``symm_mem_enabled`` are accepted
    and ignored) backed by tp-allreduce.

    ``fully_connected`` means what vLLM's own class means: every pair of
    the group's GPUs is NVLink-connected (``fully_connected_fn``, vLLM's
    ``current_platform.is_fully_connected`` over the physical device ids; a
    PCIe box reports False). ``mnnvl_lamport_ag_multicast_ptr`` (and the
    other MNNVL pointers) are 0: vLLM's value when its multicast buffers are
    absent, which turns off the model paths that would use them.
    ``mnnvl_only`` is False: an enabled adapter's group is on one host."""

    engine = "vllm"

    def __init__(self, group, device, max_size=DEFAULT_MAX_SIZE, *, fully_connected_fn=None, **options):
        self.fully_connected = False
        self.mnnvl_only = False
        self.mnnvl_multicast_ptr = 0
        self.mnnvl_lamport_ag_multicast_ptr = 0
        self.mnnvl_lamport_ag_local_ptr = 0
        self.mnnvl_lamport_rs_local_ptr = 0
        # VLLM_BATCH_INVARIANT=1: every size through size-independent
        # algorithms (vLLM's own class takes every size through one path then).
        self.batch_invariant = bool(options.pop("size_independent", batch_invariant()))
        kept = {k: v for k, v in options.items() if k == "runtime"}  # vLLM-only options are ignored
        super().__init__(group, device, max_size, size_independent=self.batch_invariant, **kept)
        if not self.disabled and fully_connected_fn is not None:
            try:
                self.fully_connected = bool(fully_connected_fn(self))
            except Exception as e:  # topology query failed: say PCIe, vLLM's safe answer
                logger.warning("tp-allreduce: NVLink topology query failed (%s); fully_connected = False", e)

    def should_custom_all_gather(self, inp) -> bool:
        return self.gather_eligible(inp)

    def custom_all_gather(self, inp):
        """vLLM's ``CustomAllreduce.custom_all_gather``: ``inp`` of every
        rank along dimension 0 in rank order, or ``None`` (vLLM then gathers
        with NCCL)."""
        return self.gather_rows(inp)

    def should_custom_reduce_scatter(self, inp) -> bool:
        return self.custom_reduce_scatter_eligible(inp)

    def custom_reduce_scatter_eligible(self, inp) -> bool:
        # vLLM's own class never reduce-scatters under batch invariance (its
        # backends switch with the size); neither do we, so vLLM's own path runs.
        return not self.batch_invariant and self.scatter_eligible(inp)

    def custom_reduce_scatter(self, inp):
        """vLLM's ``CustomAllreduce.custom_reduce_scatter``: this rank's
        rows of the sum, or ``None`` (vLLM then reduce-scatters with NCCL)."""
        if not self.custom_reduce_scatter_eligible(inp):
            return None
        return self.scatter_rows(inp)

    def should_mnnvl_multimem_reduce_scatter(self, inp) -> bool:
        return False


def _vllm_fully_connected(ca):
    """vLLM's own test (``CustomAllreduce.__init__``): physical ids of the
    group's devices, gathered over the CPU group, NVLink between all pairs."""
    import torch
    import torch.distributed as dist
    from vllm.platforms import current_platform

    physical = current_platform.visible_device_id_to_physical_device_id(ca.device.index)
    mine = torch.tensor([physical], dtype=torch.int, device="cpu")
    everyone = [torch.tensor([0], dtype=torch.int, device="cpu") for _ in range(ca.world_size)]
    dist.all_gather(everyone, mine, group=ca.group)
    return current_platform.is_fully_connected([int(t.item()) for t in everyone])


def _install_into(comm, adapter_cls):
    """Puts tp-allreduce into one ``CudaCommunicator`` instance (end of its
    ``__init__``). Leaves it untouched where vLLM builds no custom allreduce
    or tp-allreduce cannot start (vLLM's own, or NCCL, stays)."""
    wanted = getattr(comm, "use_custom_allreduce", None)
    if wanted is None:  # attribute renamed: vLLM's rule is "tp groups only"
        wanted = getattr(comm, "unique_name", "").split(":")[0] == "tp"
    if not wanted or getattr(comm, "world_size", 1) <= 1:
        return
    if getattr(comm, "aiter_ar_comm", None) is not None:
        return  # ROCm's AITER path; not ours
    ours = adapter_cls(group=comm.cpu_group, device=comm.device)
    if ours.disabled:
        return
    theirs = getattr(comm, "ca_comm", None)
    comm.ca_comm = ours
    if theirs is not None and theirs is not ours and hasattr(theirs, "close"):
        try:
            theirs.close()
        except Exception as e:
            logger.warning("tp-allreduce: closing vLLM's custom allreduce failed: %s", e)
    if over_flashinfer():
        for attr, closer in (("fi_ar_comm", "destroy"), ("fi_pcie_ipc_ar_comm", "destroy")):
            other = getattr(comm, attr, None)
            if other is None:
                continue
            try:
                getattr(other, closer, lambda: None)()
            except Exception as e:
                logger.warning("tp-allreduce: closing vLLM's %s failed: %s", attr, e)
            setattr(comm, attr, None)
        for flag in ("use_flashinfer_allreduce", "use_flashinfer_pcie_ipc_allreduce"):
            if hasattr(comm, flag):
                setattr(comm, flag, False)


def install(cls, adapter_cls=TpAllreduceVllmCustomAllreduce):
    """Wraps ``cls.__init__`` and ``cls.destroy`` in place (idempotent);
    returns ``cls``."""
    if cls.__dict__.get("_tp_allreduce_installed"):
        return cls
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if not self.__dict__.get("_tp_allreduce_done"):  # once, also through installed subclasses
            self._tp_allreduce_done = True
            _install_into(self, adapter_cls)

    original_destroy = cls.__dict__.get("destroy") or getattr(cls, "destroy", None)

    def destroy(self):
        ca = getattr(self, "ca_comm", None)
        if isinstance(ca, CustomAllreduceAdapter):
            ca.close()
        if original_destroy is not None:
            original_destroy(self)

    if original_destroy is not None:
        destroy = functools.wraps(original_destroy)(destroy)
    cls.__init__ = __init__
    cls.destroy = destroy
    cls._tp_allreduce_installed = True
    return cls


def _name(cls, module, name):
    cls.__module__ = module
    cls.__name__ = cls.__qualname__ = name
    return cls


def make_communicator_class(base, adapter_cls=TpAllreduceVllmCustomAllreduce, module=__name__):
    """A subclass of ``base`` with tp-allreduce installed (``install``).
    The plugin installs into vLLM's class itself; this is for callers that
    want a separate class."""

    class TpAllreduceCudaCommunicator(base):
        pass

    return install(_name(TpAllreduceCudaCommunicator, module, "TpAllreduceCudaCommunicator"), adapter_cls)


def _turn_off_fusion(vllm_config) -> None:
    pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    if pass_config is not None and getattr(pass_config, "fuse_allreduce_rms", False):
        pass_config.fuse_allreduce_rms = False
        logger.info("tp-allreduce: %s=1 turns off vLLM's AR+RMSNorm fusion pass (FlashInfer)", OVER_FLASHINFER_SWITCH)


def install_platform(cls):
    """Wraps ``cls.check_and_update_config`` (vLLM's CUDA platform, a
    classmethod) in place (idempotent): under
    ``TP_ALLREDUCE_VLLM_OVER_FLASHINFER=1`` it then turns off the
    compile-time AR+RMSNorm fusion pass (FlashInfer's kernel) so those
    allreduces stay allreduces that reach tp-allreduce. Returns ``cls``."""
    if cls.__dict__.get("_tp_allreduce_platform"):
        return cls
    raw = cls.__dict__.get("check_and_update_config")
    if isinstance(raw, classmethod):
        original = raw.__func__
    else:
        bound = getattr(cls, "check_and_update_config", None)
        original = getattr(bound, "__func__", None)

    def check_and_update_config(klass, vllm_config):
        if original is not None:
            original(klass, vllm_config)
        if over_flashinfer():
            _turn_off_fusion(vllm_config)

    if original is not None:
        check_and_update_config = functools.wraps(original)(check_and_update_config)
    cls.check_and_update_config = classmethod(check_and_update_config)
    cls._tp_allreduce_platform = True
    return cls
