"""Helper of the engine harness's import stubs (see ../README.md).

A stub module stands in for a heavy GPU-native library that the checked
path imports but never calls (sgl_kernel, vLLM's compiled extensions, ...).
It defines an explicit list of names; each one raises ``StubCalled`` when
called, so a check that reaches a stub fails loudly instead of passing on a
fake. Nothing here is a catch-all: a name that is not listed is an
AttributeError, as it would be with the real library missing it."""

STUBBED = []  # the stub modules imported in this process, in import order


class StubCalled(RuntimeError):
    pass


def _raiser(qualname):
    def stub(*_args, **_kwargs):
        raise StubCalled(f"{qualname} is an engine-harness stub: the real native library is not installed here")

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = qualname
    stub.__tp_allreduce_stub__ = True
    return stub


def define(namespace, module, names):
    """Puts a raising function under each of ``names`` into ``namespace``
    (a stub module's globals) and records the module as imported."""
    for name in names:
        namespace[name] = _raiser(f"{module}.{name}")
    namespace["__tp_allreduce_stub__"] = True
    STUBBED.append(module)
