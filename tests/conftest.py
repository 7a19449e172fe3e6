import importlib.util
import os

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
