import importlib.util
import multiprocessing.util
import os
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

HAVE_XLA = importlib.util.find_spec("torch_xla") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_XLA:
        once = pytest.mark.skip(reason="runs on the newest-torch stack only (CPU work, no XLA)")
        for item in items:
            if "newest_torch_only" in item.keywords:
                item.add_marker(once)
        return
    if os.environ.get("TIEKIT_REQUIRE_XLA"):
        raise pytest.UsageError("TIEKIT_REQUIRE_XLA is set but torch_xla is not installed")
    skip = pytest.mark.skip(reason="torch_xla is not installed")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Send every temporary file of the run into pytest's own folder, which keeps the last 3 runs.

    Test scripts, documentation blocks and launchers (torchrun's error files) make temporary
    folders in their own processes; under /tmp they would stay after every run.
    """
    folder = tmp_path_factory.mktemp("tmp", numbered=False)
    # This process's multiprocessing folder is made before the switch, where its exit handler can
    # still remove it after pytest has removed its own folder.
    multiprocessing.util.get_temp_dir()
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # tempfile caches the folder it chose first
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture
def xla_device():  # type: ignore[no-untyped-def]
    import torch_xla

    return torch_xla.device()


if HAVE_XLA:
    # torch's autograd engine sizes its per-device queues at the first backward; the XLA
    # runtime must be up before that, or a later backward on XLA hits an internal assert
    # ("device_ready_queues_"). CPU tests in this process run backward, so start XLA first.
    import torch_xla

    torch_xla.device()
