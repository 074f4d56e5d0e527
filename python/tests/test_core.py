"""The torch-free core (`tp_allreduce._core`): imports, ids, argument checks,
errors. Runs anywhere; the tests that need a machine without a CUDA driver
(or with one) say so when skipped."""

import builtins
import logging
import os
import random
import subprocess
import sys
import threading

import pytest
import tp_allreduce
from _gate import not_applicable
from tp_allreduce import Communicator, Id, PreparedRank, check_call_args, errors

F32, F16, BF16 = tp_allreduce.dtypes.F32, tp_allreduce.dtypes.F16, tp_allreduce.dtypes.BF16


def test_package_imports_and_reports_a_version():
    assert tp_allreduce.__version__.count(".") == 2
    assert isinstance(tp_allreduce.driver_available(), bool)
    assert tp_allreduce.DEFAULT_CAPTURE_COPY_BYTES == 8 << 20


# ------------------------------------------------------------------ ids
def test_unix_id_round_trips_through_its_string():
    made = Id.new_unix()
    try:
        text = str(made)
        assert text.startswith("tpar2:unix:")
        back = Id.parse(text)
        assert back == made and not (back != made)
        assert hash(back) == hash(made)
        assert str(back) == text
        # The repr (logs, tracebacks) keeps the secret out: the last field
        # of the string is the secret.
        secret = text.rsplit(":", 1)[1]
        assert repr(made).startswith("Id(") and "secret not shown" in repr(made)
        assert secret not in repr(made)
    finally:
        made.remove_files()


def test_tcp_id_round_trips_and_ids_differ():
    port = random.randint(20000, 60000)
    a = Id.new_tcp(f"127.0.0.1:{port}")
    b = Id.new_tcp(f"127.0.0.1:{port}")
    assert str(a).startswith(f"tpar2:tcp:127.0.0.1:{port}:")
    assert Id.parse(str(a)) == a
    assert a != b, "each id carries a fresh random secret"
    assert len({a, Id.parse(str(a)), b}) == 2
    v6 = Id.new_tcp("[::1]:29500")
    assert str(v6).startswith("tpar2:tcp:[::1]:29500:") and Id.parse(str(v6)) == v6
    assert (a == "not an id") is False


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "not a tp-allreduce rendezvous id"),
        ("bogus", "not a tp-allreduce rendezvous id"),
        ("tpar9:unix:/tmp/x/rdv.sock:" + "0" * 32, "unsupported id version"),
        ("tpar2:unix:/tmp/x/rdv.sock:" + "z" * 32, "32 lowercase hex digits"),
        ("tpar2:unix:/tmp/x/rdv.sock:1234", "32 lowercase hex digits"),
        ("tpar2:tcp:not-an-address:" + "0" * 32, "IP:port"),
        ("tpar2:carrier-pigeon:x:" + "0" * 32, "unknown transport"),
        ("tpar2:tcp:127.0.0.1:1 :" + "0" * 32, "printable ASCII"),
        ("x" * 300, "longer than"),
    ],
)
def test_bad_id_strings_raise_invalid_usage_with_a_reason(text, words):
    with pytest.raises(errors.InvalidUsage) as info:
        Id.parse(text)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_id_errors_never_show_the_secret():
    # Ids come from env files (often with a trailing newline) and errors
    # land in logs and tracebacks: whitespace around an id is ignored, and
    # no error shows the secret or a piece of it.
    secret = "0123456789abcdef" * 2
    good = "tpar2:tcp:127.0.0.1:29500:" + secret
    assert Id.parse(good + "\n") == Id.parse(good) == Id.parse(" " + good + "\r\n")
    for bad in [good + "0", good.replace(secret, secret.upper()), good + "\n" + good, "tpar2:" + secret + ":x:y"]:
        with pytest.raises(errors.InvalidUsage) as info:
            Id.parse(bad)
        for text in (str(info.value), repr(info.value)):
            assert secret[:8] not in text and secret[8:16] not in text, text


def test_new_tcp_rejects_a_bad_address():
    with pytest.raises(errors.InvalidUsage, match="IP:port"):
        Id.new_tcp("localhost")


# ------------------------------------------------------------------ dtype codes and argument checks
def test_dtype_codes_match_sizes_and_names():
    assert (tp_allreduce._core.dtype_size(F32), tp_allreduce._core.dtype_name(F32)) == (4, "f32")
    assert (tp_allreduce._core.dtype_size(F16), tp_allreduce._core.dtype_name(F16)) == (2, "f16")
    assert (tp_allreduce._core.dtype_size(BF16), tp_allreduce._core.dtype_name(BF16)) == (2, "bf16")
    assert len({F32, F16, BF16}) == 3


@pytest.mark.parametrize("code", [3, 7, 255, 2**31])
def test_unknown_dtype_codes_raise(code):
    with pytest.raises(errors.InvalidUsage, match=f"unknown dtype code {code}"):
        tp_allreduce._core.dtype_size(code)
    with pytest.raises(errors.InvalidUsage, match="valid: 0 = f32, 1 = f16, 2 = bf16"):
        check_call_args(4096, 8192, 16, code)


def test_valid_call_arguments_pass():
    assert check_call_args(0x1000, 0x2000, 1024, BF16) == "bf16"
    assert check_call_args(0x1000, 0x1000, 1024, F32) == "f32", "in place is allowed"
    assert check_call_args(0, 0, 0, F16) == "f16", "an empty call touches no pointer"


@pytest.mark.parametrize(
    "send, recv, count, dtype, words",
    [
        (0, 0x2000, 4, BF16, "null device pointer"),
        (0x1000, 0, 4, F32, "null device pointer"),
        (0x1001, 0x2000, 4, BF16, "aligned to the 2-byte size of bf16"),
        (0x1000, 0x2002, 4, F32, "aligned to the 4-byte size of f32"),
        (0x1000, 0x1008, 16, F32, "overlap without being equal"),
        (0x1008, 0x1000, 16, F32, "overlap without being equal"),
        (0x1000, 0x2000, 2**62, F32, "overflow"),
        (2**64 - 16, 0x2000, 8, F32, "overflow"),
    ],
)
def test_bad_call_arguments_raise_instead_of_crashing(send, recv, count, dtype, words):
    with pytest.raises(errors.InvalidUsage, match=words):
        check_call_args(send, recv, count, dtype)


def test_negative_or_huge_integers_are_python_errors():
    with pytest.raises(OverflowError):
        check_call_args(-1, 0x2000, 4, BF16)
    with pytest.raises(OverflowError):
        check_call_args(0x1000, 0x2000, -4, BF16)
    with pytest.raises(OverflowError):
        check_call_args(2**64, 0x2000, 4, BF16)
    with pytest.raises(TypeError):
        check_call_args("0x1000", 0x2000, 4, BF16)


def test_pointer_exportability_rejects_null():
    with pytest.raises(errors.InvalidUsage, match="null pointer"):
        tp_allreduce.pointer_is_ipc_exportable(0)


# ------------------------------------------------------------------ communicator construction
def test_communicator_rejects_a_bad_id_before_touching_the_gpu():
    with pytest.raises(errors.InvalidUsage, match="invalid rendezvous id"):
        Communicator(0, 2, "not-an-id", 0)
    with pytest.raises(errors.InvalidUsage, match="Id or its string"):
        Communicator(0, 2, 12345, 0)


def test_communicator_rejects_an_unknown_algorithm():
    made = Id.new_unix()
    try:
        with pytest.raises(errors.InvalidUsage, match="unknown algorithm `fastest`"):
            Communicator(0, 2, made, 0, algorithm="fastest")
    finally:
        made.remove_files()


def test_the_torch_layer_without_torch_says_to_install_the_torch_extra():
    # `sys.modules["torch"] = None` makes `import torch` fail as if torch
    # were not installed, on machines with torch too.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "try:\n"
        "    import tp_allreduce.torch\n"
        "except ModuleNotFoundError as e:\n"
        "    print('NAME', e.name)\n"
        "    print('MESSAGE', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "NAME torch" in out.stdout, out.stdout + out.stderr
    assert "`torch` extra" in out.stdout and "[torch]" in out.stdout, out.stdout


def _unix_id_dir(made):
    # "tpar2:unix:<base>/tpar-<16 hex>/rdv.sock:<secret>"
    return os.path.dirname(str(made)[len("tpar2:unix:") :].rsplit(":", 1)[0])


def test_a_failed_rank_0_removes_its_unix_ids_directory_and_other_ranks_leave_it():
    made = Id.new_unix()
    try:
        directory = _unix_id_dir(made)
        assert os.path.basename(directory).startswith("tpar-") and os.path.isdir(directory)
        with pytest.raises(errors.InvalidUsage, match="unknown algorithm"):
            Communicator(1, 2, made, 0, algorithm="fastest")
        assert os.path.isdir(directory), "rank 1 removed the directory rank 0 owns"
        with pytest.raises(errors.InvalidUsage, match="unknown algorithm"):
            Communicator(0, 2, made, 0, algorithm="fastest")
        assert not os.path.exists(directory), f"a failed rank 0 left {directory} behind"
        if not tp_allreduce.driver_available():
            again = Id.new_unix()
            try:
                with pytest.raises(errors.NoDriverError):
                    Communicator(0, 2, again, 0)
                assert not os.path.exists(_unix_id_dir(again)), "rank 0 without a driver left its directory"
            finally:
                again.remove_files()
    finally:
        made.remove_files()


def test_communicator_without_a_driver_raises_no_driver_error():
    if tp_allreduce.driver_available():
        not_applicable("a CUDA driver is present (this test is for machines without one)")
    made = Id.new_unix()
    try:
        with pytest.raises(errors.NoDriverError, match="no CUDA driver") as info:
            Communicator(0, 2, made, 0)
        assert isinstance(info.value, errors.DriverError)
        with pytest.raises(errors.NoDriverError):
            tp_allreduce.pointer_is_ipc_exportable(0x1000)
    finally:
        made.remove_files()


def test_prepared_rank_checks_the_algorithm_then_the_driver():
    with pytest.raises(errors.InvalidUsage, match="unknown algorithm `fastest`"):
        PreparedRank(0, algorithm="fastest")
    if tp_allreduce.driver_available():
        return  # the GPU tests create real ones
    with pytest.raises(errors.NoDriverError, match="no CUDA driver"):
        PreparedRank(0)


# ------------------------------------------------------------------ logging
class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.name, record.levelno, record.getMessage()))


def test_rust_log_records_reach_python_logging_under_tp_allreduce():
    """The Rust `log` facade (what the library logs through) bridged to
    Python's logging: logger names under `tp_allreduce`, levels mapped, the
    Python logger's level consulted on every record (reconfiguring it later
    takes effect), records from other threads too."""
    logger = logging.getLogger("tp_allreduce")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    try:
        logger.setLevel(logging.WARNING)
        tp_allreduce._core._emit_log("info", "below the level")
        tp_allreduce._core._emit_log("warn", "a fallback")
        logger.setLevel(logging.INFO)
        tp_allreduce._core._emit_log("info", "a creation line")
        t = threading.Thread(target=tp_allreduce._core._emit_log, args=("error", "from another thread"))
        t.start()
        t.join(10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert handler.records == [
        ("tp_allreduce.python", logging.WARNING, "a fallback"),
        ("tp_allreduce.python", logging.INFO, "a creation line"),
        ("tp_allreduce.python", logging.ERROR, "from another thread"),
    ]
    with pytest.raises(errors.InvalidUsage, match="unknown log level"):
        tp_allreduce._core._emit_log("loud", "x")


# ------------------------------------------------------------------ exception hierarchy
def test_exception_hierarchy():
    e = errors
    for name in e.__all__:
        assert issubclass(getattr(e, name), e.TpAllreduceError), name
        assert getattr(tp_allreduce, name) is getattr(e, name), "re-exported at the top level"
    assert issubclass(e.InvalidUsage, ValueError)
    assert issubclass(e.TimeoutError, builtins.TimeoutError)
    assert issubclass(e.DeviceTimeout, e.TimeoutError)
    assert issubclass(e.RendezvousTimeout, e.TimeoutError)
    assert issubclass(e.RendezvousTimeout, e.RendezvousError)
    assert issubclass(e.NoDriverError, e.DriverError)
    assert not issubclass(e.Unsupported, ValueError)
