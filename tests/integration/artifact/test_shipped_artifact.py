"""The shipped default guard, as deployed, reproduces the scores it was calibrated on.

Loading goes through the registry and the metadata reader, scoring through the live chain
(recorded prompt and budget): any change to loading, generation, capture or the scorer that
moves a score shows up here as live != stored. Where this machine's bit-deciding kernel
facts are the calibration's (:func:`abstain_guard.contract.kernels.bit_deciding`) the scores must
agree to float64 rounding; on other kernels (another CPU model, another forced ATen
capability) within the library's stated tolerance, with the guard's kernel note in every
decision. ``make test-foreign`` runs it on ATen's scalar kernels and MKL's AVX2 branch, where
the scores must move and the guard must warn once and note every decision."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _kernel_notes import calibration_kernel_differences

from abstain_guard import GuardArtifact, default_artifact_path
from abstain_guard.calibration.measure.held_out import artifact_items
from abstain_guard.contract.kernels import STATED_TOLERANCE
from abstain_guard.errors import KernelMismatchWarning
from abstain_guard.guard import policy
from abstain_guard.guard.chains import load_guard_chain

pytestmark = pytest.mark.model

N_QUESTIONS = 8


def live_and_stored(model, n: int) -> tuple[list[float], list[float], list[list[str]]]:
    """Live scores of the artifact's first ``n`` calibration answers through the deployed
    chain, the stored scores, and each decision's guarantee warnings."""
    artifact = GuardArtifact.load(default_artifact_path())
    _, held_out, _ = artifact_items(artifact)
    by_id = {item.id: item for item in held_out}
    calibration_ids = list(artifact.metadata["calibration_ids"])
    assert len(calibration_ids) == artifact.scores.shape[0]
    items = [by_id[item_id] for item_id in calibration_ids[:n]]
    (kind,) = {item.kind for item in items}
    chain, _, _ = load_guard_chain(artifact, model=model, kind=kind)
    # asked at once, as a deployment is (LangChain's batch, one thread per question): the
    # engine decodes them in shared steps, which give each row the bits it gets alone
    # (adapters/engine/threads.py; tests/test_scheduler.py)
    replies = chain.batch(
        [{"question": item.prompt_text()} for item in items],
        config={"max_concurrency": model.max_batch_size},
    )
    decisions = [reply.response_metadata["abstention"] for reply in replies]
    live = [decision["score"] for decision in decisions]
    stored = [float(score) for score in artifact.scores[:n]]
    notes = [list(decision["guarantee"].get("warnings", [])) for decision in decisions]
    return live, stored, notes


def test_shipped_artifact_scores_its_calibration_answers_identically(
    default_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy, "_KERNEL_NOTES_GIVEN", set())  # the warning is once a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        live, stored, notes = live_and_stored(default_model, N_QUESTIONS)
    warned = [str(w.message) for w in caught if issubclass(w.category, KernelMismatchWarning)]
    differences = calibration_kernel_differences(
        GuardArtifact.load(default_artifact_path()), default_model.decoding_settings()["kernels"]
    )
    if not differences:
        # Same kernels as calibration (same ATen capability, MKL branch and -- MKL's branch
        # being OFF -- the same CPU model): the guard decodes on the recorded path and
        # computes bitwise the same features; the scores agree to float64 rounding (measured
        # max |Δ| = 1.1e-16: calibration evaluated its answers as one batch through a BLAS
        # matrix-vector product, the guard each answer on its own). Anything that changes the
        # prompt, budget, decode path, tokens, capture or scorer moves a score by far more
        # (~1e-5).
        assert all(not n for n in notes) and not warned, (notes, warned)
        np.testing.assert_allclose(live, stored, rtol=0, atol=1e-12)
        return
    # Another CPU's kernels: within the stated tolerance, one warning in the process and
    # exactly that note in every decision.
    assert len(warned) == 1, warned
    assert all(n == warned for n in notes), notes
    diffs = np.abs(np.array(live) - np.array(stored))
    assert diffs.max() <= STATED_TOLERANCE, diffs
    if any(d.startswith("aten_capability: 'DEFAULT' here vs 'AVX2'") for d in differences):
        # ATen's scalar kernels (the foreign-kernel mode, ``make test-foreign``): another
        # order of reductions in every norm and softmax, so the scores do move (measured
        # 3.8e-6 at most on these answers).
        assert "aten_capability: 'DEFAULT' here vs 'AVX2' at calibration" in warned[0]
        assert diffs.max() > 0, diffs
