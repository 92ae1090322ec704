"""Where the shipped default guard lives."""

from __future__ import annotations

from pathlib import Path

from abstain_guard.errors import ArtifactNotFoundError

DEFAULT_ARTIFACT_DIR = Path(__file__).with_name("default_guard")
"""Where the shipped artifact lives inside the package (it may be missing from a build
without it; :func:`default_artifact_path` checks)."""


def default_artifact_path() -> Path:
    """The artifact shipped with the package: the embedded SmolLM2-135M-Instruct calibrated
    on the built-in probe set with the ``probe_mid`` scorer (``make default-guard`` rebuilds
    it; ``configs/default_guard.yaml`` says why that scorer).

    Raises:
        ArtifactNotFoundError: if the package was installed without it.
    """
    if not (DEFAULT_ARTIFACT_DIR / "manifest.json").is_file():
        raise ArtifactNotFoundError(
            f"The default guard artifact is missing from {DEFAULT_ARTIFACT_DIR}. Rebuild it with "
            "`make default-guard`, or calibrate your own: "
            "abstain-guard calibrate --data builtin --out guard/"
        )
    return DEFAULT_ARTIFACT_DIR
