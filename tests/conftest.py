"""Shared fixtures. Tests that load the real default model are marked ``model`` and share
one loaded model per session through :func:`default_model`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The library asks for its portable CPU kernels when abstain_guard.adapters is imported,
# before torch computes (ATen reads the setting once): import it before any test module can
# run a torch op at import time, so every test computes on the kernels the library records.
import abstain_guard.adapters  # noqa: F401


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct as a GeometryChatModel, loaded once per session,
    generating at most 24 tokens as the shipped default guard was calibrated."""
    from abstain_guard.adapters import load_default_model

    return load_default_model(max_new_tokens=24)


@pytest.fixture(scope="session")
def default_model_with(default_model):
    """``default_model_with(max_new_tokens=16)``: the session model with other settings on
    the same loaded weights -- what ``load_default_model(**settings)`` (or a calibration
    config naming the default model) loads, without loading it again."""

    def make(**settings):
        model = default_model.model_copy(update=settings)
        model._shared = default_model._shared  # the same loaded weights
        return model

    return make


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """One local Ray cluster (2 CPUs) for the session: Ray calibration and Ray Serve tests.

    Its processes start WITHOUT this process's kernel settings (the library's pinned ATen
    capability and MKL branch, and its mode flags), as the nodes of a cluster started with
    ``ray start`` do: what reaches a replica is only what the library passes it
    (``pinned_kernel_env`` in each ``runtime_env``). A replica that escaped the pin would
    compute on this machine's native kernels -- in the foreign-kernel mode
    (``make test-foreign``) other kernels than the driver's, so its answers would differ."""
    import ray

    from abstain_guard.adapters.engine.kernel_env import pinned_kernel_env

    saved = {k: os.environ.pop(k) for k in pinned_kernel_env()}
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=200 * 1024**2,
            _temp_dir=f"/tmp/agray-{os.getpid()}",
            log_to_driver=False,
        )
    finally:
        os.environ.update(saved)
    yield ray
    ray.shutdown()


# --- tiers ----------------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
#: What only the integration tier loads: the embedded model and a Ray cluster (the vLLM
#: engine's tests start it themselves and live in tests/integration/backends/).
INTEGRATION_FIXTURES = {
    "default_model": "model",
    "default_model_with": "model",
    "ray_cluster": "ray",
}


def _tier(item: pytest.Item) -> str:
    return Path(item.path).resolve().relative_to(TESTS).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (``unit`` / ``integration``, from its folder) and with
    ``model`` / ``ray`` where it uses those fixtures; refuse a unit test that loads them.

    Under ``pytest -n --dist loadfile --no-loadscope-reorder`` (make test) a file's tests
    stay on one worker, so module fixtures (a vLLM server, a calibration) are built once, and
    files start in the order of :func:`_start_rank`: the longest first, the unit tier fills
    the gaps."""
    ray_files = {item.path for item in items if "ray_cluster" in item.fixturenames}
    for item in items:
        tier = _tier(item)
        item.add_marker(tier)
        used = {INTEGRATION_FIXTURES[f] for f in item.fixturenames if f in INTEGRATION_FIXTURES}
        if tier == "unit" and used:
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(used)}: tests that load the embedded model or a "
                "Ray cluster belong under tests/integration/"
            )
        for mark in sorted(used):
            item.add_marker(mark)
    items.sort(key=lambda it: _start_rank(it, ray_files))


def _start_rank(item: pytest.Item, ray_files: set[Path]) -> int:
    """0: files marked ``vllm`` (the vLLM server's module is the longest file), 1: the rest
    of the integration tier, 2: its files that start a Ray cluster (a cluster idles until its
    worker ends), 3: the unit tier."""
    if _tier(item) == "unit":
        return 3
    if item.get_closest_marker("vllm") is not None:
        return 0
    return 2 if item.path in ray_files else 1
