"""The selection ledger (issue 57): every scorer evaluated on an artifact's calibration answers
is recorded beside it, and K in δ/K is counted from that record — a selection's candidates,
or the chosen scorer alone when it was chosen on a selection split or named before the data,
plus every other name the ledger holds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _selection_fakes import _artifact, _recorded

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.files import LEDGER
from abstain_guard.errors import ArtifactSchemaError, ArtifactWriteError, InvalidInputError
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.ledger import (
    LedgerEntry,
    ledger_lines,
    looked_at,
    parse_ledger,
)
from abstain_guard.guarantee.selection import SELECTION_SPLIT, ScorerSelection


def _risk_threshold(art: GuardArtifact, eps: float, level: float) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        return conformal.risk_threshold(art.scores, art.correct, eps, level).threshold


def _looks(*names: str, answers: str = "calibration+test") -> list[LedgerEntry]:
    return [LedgerEntry.now(n, by="abstain-guard evaluate", answers=answers) for n in names]


def test_the_ledger_round_trips_and_counts_each_name_on_calibration_answers_once() -> None:
    entries = [
        *_looks("perplexity", "probe_mid", "perplexity"),
        *_looks("type_floor", answers="test"),  # the certificate never reads these
        LedgerEntry("chunk_rule:every_8", "rule", "audit", "2026-11-01", evidence="commit abc"),
    ]
    assert parse_ledger(ledger_lines(entries)) == entries
    assert looked_at(entries) == ("perplexity", "probe_mid", "chunk_rule:every_8")
    assert len({"perplexity", "geometry"} | set(looked_at(entries))) == 4  # K: each name once
    assert looked_at([]) == ()


def test_a_malformed_ledger_line_is_named_with_what_to_do() -> None:
    good = ledger_lines(_looks("perplexity"))
    with pytest.raises(InvalidInputError, match=r"ledger.jsonl line 2 .*Repair or remove"):
        parse_ledger(good + '{"name": "x"}\n')
    with pytest.raises(InvalidInputError, match="kind must be one of"):
        LedgerEntry("x", "vibe", "me", "now")  # type: ignore[arg-type]


def test_ledger_names_beyond_the_candidates_raise_k_and_the_certified_threshold(
    tmp_path: Path,
) -> None:
    plain = _artifact(None)
    art = _artifact(_recorded(plain, k=5))  # chosen among perplexity and other0..3
    art.save(tmp_path / "guard")
    cfg = GuardConfig(mode="risk", risk_target=0.3, delta=0.1)
    before = art.decision_rule(cfg)
    # an evaluation on the calibration answers: two names already counted, two new ones
    art.record_looks(_looks("perplexity", "other0", "probe_mid", "type_floor"))
    assert art.n_candidates == 7
    after = art.decision_rule(cfg)  # the cached rule was dropped
    assert after.threshold == _risk_threshold(art, 0.3, 0.1 / 7) < before.threshold
    assert after.guarantee.delta_per_candidate == pytest.approx(0.1 / 7)
    assert after.guarantee.selection["ledger"] == ["probe_mid", "type_floor"]
    assert "ledger records 2 more" in after.guarantee.statement
    assert "(K = 7)" in after.guarantee.statement
    # on disk: the next load counts the same K; a save carries the ledger, outside checksums
    loaded = GuardArtifact.load(tmp_path / "guard")
    assert loaded.n_candidates == 7 and len(loaded.ledger) == 4
    loaded.save(tmp_path / "copy")
    manifest = json.loads((tmp_path / "copy" / "manifest.json").read_text())
    assert LEDGER not in manifest["checksums"]
    assert GuardArtifact.load(tmp_path / "copy").n_candidates == 7
    # the same names again add nothing; test-only looks add nothing
    loaded.record_looks(_looks("probe_mid") + _looks("geometry", answers="test"))
    assert GuardArtifact.load(tmp_path / "guard").n_candidates == 7


def test_a_scorer_fixed_before_the_data_pays_only_for_what_was_looked_at(tmp_path: Path) -> None:
    art = _artifact(None)
    art.save(tmp_path / "guard")
    cfg = GuardConfig(mode="risk", risk_target=0.3, delta=0.1)
    art.record_looks(_looks("perplexity"))  # its own scorer: still K = 1
    assert art.selection is None and art.n_candidates == 1
    art.record_looks(_looks("perplexity", "max_sequence_probability", "geometry"))
    loaded = GuardArtifact.load(tmp_path / "guard")
    assert loaded.n_candidates == 3 and loaded.selection is not None
    assert loaded.selection.rule == "fixed"
    rule = loaded.decision_rule(cfg)
    assert rule.threshold == _risk_threshold(loaded, 0.3, 0.1 / 3)
    assert "named before this calibration data was read" in rule.guarantee.statement


def test_a_choice_on_a_selection_split_certifies_at_delta_until_the_ledger_grows() -> None:
    plain = _artifact(None)
    split = ScorerSelection(
        candidates=("perplexity", "geometry", "probe_mid"),
        chosen="perplexity",
        risk_target=0.3,
        delta=0.1,
        data="a selection split of 400 answers, apart from the calibration split",
        n=plain.n,
        method="fixed_sequence_multistart",
        choice="most certified participation on the selection split",
        rule=SELECTION_SPLIT,
    )
    art = _artifact(split)
    assert art.n_candidates == 1
    cfg = GuardConfig(mode="risk", risk_target=0.3, delta=0.1)
    assert art.decision_rule(cfg).threshold == plain.decision_rule(cfg).threshold
    assert "selection split this certificate never reads" in (
        art.decision_rule(cfg).guarantee.statement
    )
    art.record_looks(_looks("geometry", "probe_mid"))  # compared again, on calibration answers
    assert art.n_candidates == 3


def test_a_ledger_that_cannot_be_written_counts_nothing(tmp_path: Path) -> None:
    art = _artifact(None)
    art.save(tmp_path / "guard")
    (tmp_path / "guard" / LEDGER).mkdir()  # fails for root too, unlike a read-only folder
    with pytest.raises(ArtifactWriteError, match="Could not write the artifact"):
        art.record_looks(_looks("geometry"))
    assert art.n_candidates == 1 and art.ledger == ()


def test_a_ledger_that_is_not_json_lines_stops_the_load(tmp_path: Path) -> None:
    _artifact(None).save(tmp_path / "guard")
    (tmp_path / "guard" / LEDGER).write_text("not json\n", encoding="utf-8")
    with pytest.raises(ArtifactSchemaError, match="line 1 is not a ledger entry"):
        GuardArtifact.load(tmp_path / "guard")


def test_a_ledger_that_cannot_be_read_stops_the_load(tmp_path: Path) -> None:
    # a ledger skipped as "absent" would certify at delta/K with the looks it records left
    # out of K; before this test the load died with an untyped IsADirectoryError
    _artifact(None).save(tmp_path / "guard")
    (tmp_path / "guard" / LEDGER).mkdir()
    with pytest.raises(ArtifactSchemaError, match=r"not a regular file.*cannot be counted in K"):
        GuardArtifact.load(tmp_path / "guard")


def test_no_ledger_leaves_every_existing_artifact_as_it_was(tmp_path: Path) -> None:
    art = _artifact(_recorded(_artifact(None), k=5))
    art.save(tmp_path / "guard")
    assert not (tmp_path / "guard" / LEDGER).exists()
    loaded = GuardArtifact.load(tmp_path / "guard")
    assert loaded.ledger == () and loaded.n_candidates == 5
    assert np.array_equal(loaded.scores, art.scores)
