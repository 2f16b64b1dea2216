"""Each package's public surface is exactly what it means to export (the package docstrings say what each holds)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

EXPORTS: dict[str, set[str]] = {
    "broker": {
        "BUILD", "DEFAULT_ENDPOINT", "PROTOCOL_VERSION", "RUNTIME", "TOPIC_EPISODE_END",
        "TOPIC_RUN_END", "TOPIC_RUN_START", "BFloat16Bits", "Batch", "Broker", "BrokerClosedError", "BrokerError",
        "BrokerStatistics", "Consumer", "ConsumerError", "CurveClient", "CurveServer",
        "EpisodeEnd", "FieldSpec", "Gap", "KeyPair", "Message", "MessageOf", "NumpyMessage", "Phase", "Policy",
        "PublisherStatistics", "RunEnd", "RunStart", "SchemaError", "SecurityError", "SendTimeoutError",
        "Subscriber", "SubscriberStatistics", "SubscriberTimeoutError", "Subscription",
        "TopicSchema", "TransportError", "VariationSample", "WireFormatError", "ZmqPublisher", "batch_topic",
        "decode", "encode", "load_keypair", "load_public_keys", "variation_topic", "write_keypair",
    },
    "capture": {
        "CaptureError", "CartPoleRandomizer", "FieldTree", "FunctionTerm", "Recorder", "RecorderClosedError",
        "RecordingVectorEnv",
        "SchemaError", "SelectorError", "Term", "TermError", "VariationError", "WorldSelector",
        "CheckMode", "WorldsCheck", "flatten_fields", "normalize_worlds",
    },
    "consumers": {
        "OUTCOME_COLUMNS", "ConsumersError", "FieldStatistics", "FinishedEpisode",
        "LiveStatistics", "LiveSummary", "Retention", "RetentionError", "RetentionSchemaError", "RetentionStatistics",
        "SampleArrays", "SampleTableError", "SampleTable",
    },
    "consumers.sensitivity": {
        "CONVERGENCE_FRACTIONS", "CONVERGENCE_RULE", "CONVERGENCE_WIDTH", "DEFAULT_METHODS", "DUMMY",
        "INFLUENCE_RULE", "LIVE_TOPICS", "METHODS", "MIN_BIN_EPISODES", "Analysis", "Factor", "IndexRow",
        "LiveResult", "MissingDependencyError", "RateRow", "SensitivityError", "analyze", "dummy_seed",
        "render_table", "run_live", "to_json", "write_outputs",
    },
    "storage": {
        "DaemonStatistics", "EpisodeBatch", "EpisodeNotFoundError", "EpisodeRows", "episode_coordinate", "ExportMode", "FencedStore",
        "LeaseExpiredError", "QueryError", "RejectedMessage",
        "Partition", "Problem", "RunNotFoundError", "RunReport", "RunStore", "RunStoreWriter", "RunWriter", "StorageError",
        "StoreDaemon", "StoreDamagedError", "StoreFormatError", "StoreLease", "StoreLock", "StoreLockedError", "Table",
        "VerifyReport", "daemon_status", "failed_store_location", "repair_store", "verify_store",
    },
}


def _isort(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions; alphabetical within each."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_exported_surface(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == EXPORTS[package]
    assert list(module.__all__) == sorted(module.__all__, key=_isort), "keep __all__ sorted"
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name} is in __all__ but missing"


def test_importing_the_packages_stays_light() -> None:
    """Optional integrations are imported lazily."""
    heavy = ["gymnasium", "SALib", "matplotlib", "rich", "pandas", "xarray", "dask"]
    code = (
        "import sys, broker, capture, capture.variations, capture.gymnasium, capture.cartpole, consumers\n"
        "import consumers.sensitivity, consumers.sensitivity.cli, storage, storage.demo\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
