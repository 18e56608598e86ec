"""The registry refuses damage (issue 37): a pointer, card or model.pt that cannot be read is named
as damaged, never taken as absent, and promotion onto it stops unless repair is asked for.

Real registries on a local root and on moto's S3 server, written by the real `registry.promote`,
then damaged the way a disk, a hand edit or a half-finished copy damages files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_config import CleanupConfig
from storage_io import MANIFEST, StorageLayout, atomic_write_bytes, atomic_write_json, exists, join, read_bytes
from tests.support.cli import ROOT
from tests.support.registry import candidate, light_candidate, make_dataset, s3_objects
from training.champion import lookup, registry, registry_files, registry_repair

MODEL = "mnist-resnet18"


@pytest.fixture
def champion_root(tmp_path):
    """A local root whose champion is v1 at 96.7%; (layout, dataset folder)."""
    layout = StorageLayout.create(str(tmp_path / "root"), "unused")
    data = make_dataset(layout, "mnist-a")
    assert registry.promote(layout, MODEL, candidate(layout, "good", 0.967, data)).promoted
    return layout, data


def pointer_file(layout) -> Path:
    return Path(registry_files.champion_path(layout.root, MODEL))


POINTER_DAMAGE = {
    "garbage": (b"\x00garbage\xff", "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "a list": (b"[1]", "holds list"),
    "a string version": (b'{"version": "1", "test_accuracy": 0.9, "data_hash": "x", "run_name": "r"}', "not a version number"),
    "NaN accuracy": (b'{"version": 1, "test_accuracy": NaN, "data_hash": "x", "run_name": "good"}', "not valid JSON"),
    "accuracy above 1": (b'{"version": 1, "test_accuracy": 96.7, "data_hash": "x", "run_name": "good"}', "test_accuracy"),
    "an unpublished version": (b'{"version": 9, "test_accuracy": 0.9, "data_hash": "x", "run_name": "good"}', "names v9, which is not a published version"),
    "another run": (b'{"version": 1, "test_accuracy": 0.9, "data_hash": "x", "run_name": "bad"}', "but v1's card is run 'good'"),
}


@pytest.mark.parametrize("damage", list(POINTER_DAMAGE))
def test_a_damaged_pointer_is_named_and_never_taken_as_no_champion(champion_root, damage):
    layout, data = champion_root
    content, why = POINTER_DAMAGE[damage]
    pointer_file(layout).write_bytes(content)
    found = registry_files.problems(layout.root, MODEL)
    assert len(found) == 1 and found[0].startswith(f"{pointer_file(layout)}: damaged") and why in found[0]
    # The reported case: a 10% candidate is not promoted over the 96.7% v1 as "the first of its name"
    with pytest.raises(registry_files.RegistryDamaged, match="Promotion stopped") as refused:
        registry.promote(layout, MODEL, candidate(layout, "bad", 0.10, data))
    assert str(pointer_file(layout)) in str(refused.value) and "--repair" in str(refused.value)
    assert pointer_file(layout).read_bytes() == content and registry_files.versions(layout.root, MODEL) == [1]
    with pytest.raises(registry_files.RegistryDamaged, match="damaged") as unreadable:  # what flows.predict reads
        lookup.resolve(layout.root, MODEL)
    assert str(pointer_file(layout)) in str(unreadable.value) and "no champion yet" not in str(unreadable.value)


def test_repair_moves_the_damage_aside_and_restores_the_newest_intact_champion(champion_root):
    layout, data = champion_root
    pointer_file(layout).write_bytes(b"garbage")
    result = registry.promote(layout, MODEL, candidate(layout, "bad", 0.10, data), repair=True)
    assert not result.promoted and "does not beat champion v1's 96.70%" in result.reason
    pointer = registry_files.read_champion(layout.root, MODEL)
    assert pointer["version"] == 1 and pointer["run_name"] == "good" and pointer["test_accuracy"] == 0.967
    aside = list(Path(registry_files.model_dir(layout.root, MODEL), registry_files.DAMAGED_DIR).glob("*/champion"))
    assert [p.read_bytes() for p in aside] == [b"garbage"]  # kept, not deleted
    assert registry_files.problems(layout.root, MODEL) == []


def test_a_missing_pointer_beside_published_versions_is_damage(champion_root):
    layout, data = champion_root
    pointer_file(layout).unlink()
    assert registry_files.problems(layout.root, MODEL) == [f"{pointer_file(layout)}: missing although v1 are published"]
    with pytest.raises(registry_files.RegistryDamaged, match="missing although v1"):
        lookup.resolve(layout.root, MODEL)
    with pytest.raises(registry_files.RegistryDamaged):
        registry.promote(layout, MODEL, candidate(layout, "bad", 0.10, data))
    assert not pointer_file(layout).exists()


@pytest.mark.parametrize("card", [b"{", b"[]", b'{"version": 2}', b'{"version": 1, "run_name": "good"}'])
def test_a_damaged_card_is_named_not_unpublished(champion_root, card):
    layout, data = champion_root
    card_path = Path(registry_files.version_dir(layout.root, MODEL, 1), registry_files.CARD_FILE)
    card_path.write_bytes(card)
    for call in (lambda: lookup.resolve(layout.root, MODEL), lambda: lookup.resolve(layout.root, MODEL, 1)):
        with pytest.raises(registry_files.RegistryDamaged, match=f"{card_path}: damaged") as exc:
            call()
        assert "is not a published version" not in str(exc.value)
    with pytest.raises(registry_files.RegistryDamaged, match="model_card.json: damaged"):
        registry.promote(layout, MODEL, candidate(layout, "next", 0.99, data))
    assert card_path.read_bytes() == card and registry_files.versions(layout.root, MODEL) == [1]


def test_a_damaged_card_keeps_all_raw_and_datasets_through_cleanup(run_tree):
    from tasks.cleanup import cleanup

    layout, raw, dataset, trained, evaluation = run_tree
    atomic_write_json(join(dataset.directory, MANIFEST), {"fingerprint": "abc"})
    other = make_dataset(layout, "mnist-other")
    assert registry.promote(layout, MODEL, candidate(layout, "older", 0.9, other)).promoted
    Path(registry_files.version_dir(layout.root, MODEL, 1), registry_files.CARD_FILE).write_text("{")
    report = cleanup.fn(CleanupConfig(delete_raw=True, delete_parquet=True), raw, dataset, trained, evaluation, layout)
    assert set(report.kept) == {raw.directory, dataset.directory} and report.paths == []
    assert "model_card.json: damaged" in report.kept[dataset.directory]
    assert exists(join(raw.directory, "f.gz")) and exists(join(dataset.directory, "part.parquet"))


def test_a_tampered_model_pt_is_refused_before_any_scoring(champion_root):
    layout, data = champion_root
    weights = Path(registry_files.version_dir(layout.root, MODEL, 1), "model.pt")
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    weights.write_bytes(bytes(blob))
    started = time.monotonic()
    with pytest.raises(registry_files.RegistryDamaged, match="model.pt: damaged.*does not match its sha256"):
        lookup.resolve(layout.root, MODEL)
    assert time.monotonic() - started < 10
    with pytest.raises(registry_files.RegistryDamaged, match="model.pt: damaged"):
        registry.promote(layout, MODEL, candidate(layout, "next", 0.99, data))


def test_the_registry_command_checks_and_repairs(champion_root, capsys):
    layout, data = champion_root
    weights = Path(registry_files.version_dir(layout.root, MODEL, 1), "model.pt")
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    checked = subprocess.run([sys.executable, "-m", "training.champion.registry", "--storage-root", layout.root],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 1 and "model.pt: damaged" in checked.stderr and "Traceback" not in checked.stderr
    assert weights.stat().st_size == 1000  # a check changes nothing
    capsys.readouterr()
    assert registry_repair.main(["--storage-root", layout.root, "--repair"]) == 0
    repaired = capsys.readouterr().out
    assert "moved v1 to" in repaired and "moved the champion pointer" in repaired
    assert registry_repair.main(["--storage-root", layout.root]) == 0 and not pointer_file(layout).exists()
    assert "intact (no champion yet" in capsys.readouterr().out
    # the damaged version is kept aside; its number is never used again
    assert list(Path(registry_files.model_dir(layout.root, MODEL), registry_files.DAMAGED_DIR).glob("*/v1/model.pt"))
    assert registry.promote(layout, MODEL, candidate(layout, "next", 0.99, data)).version == 2
    assert registry_repair.main(["--storage-root", layout.root, "--model", "Bad\nName"]) == 2
    assert "model_name" in capsys.readouterr().err


def test_a_damaged_pointer_on_s3_stops_promotion_and_repair_moves_it_aside(s3_root):
    layout = StorageLayout.create(s3_root, "unused")
    data = make_dataset(layout, "mnist-a")
    assert registry.promote(layout, MODEL, light_candidate(layout, "good", 0.967, data)).promoted
    atomic_write_bytes(registry_files.champion_path(s3_root, MODEL), b"garbage")
    with pytest.raises(registry_files.RegistryDamaged, match=f"{s3_root}/models/{MODEL}/champion: damaged"):
        registry.promote(layout, MODEL, light_candidate(layout, "bad", 0.10, data))
    with pytest.raises(registry_files.RegistryDamaged, match="damaged"):
        lookup.resolve(s3_root, MODEL)
    assert read_bytes(registry_files.champion_path(s3_root, MODEL)) == b"garbage"
    done = registry_repair.repair_registry(s3_root, MODEL)
    assert any("moved the champion pointer" in line for line in done)
    assert registry_files.read_champion(s3_root, MODEL)["version"] == 1
    assert any(key.startswith(f"models/{MODEL}/damaged/") and key.endswith("/champion") for key in s3_objects(s3_root))
    assert registry_files.problems(s3_root, MODEL) == []
    assert json.loads(read_bytes(registry_files.champion_path(s3_root, MODEL)))["path"] == f"models/{MODEL}/v1"


def test_the_damage_error_crosses_a_process_boundary_whole():
    """The evaluation stage runs in a Ray task: its exception reaches the driver pickled."""
    import pickle

    error = registry_files.RegistryDamaged(["/r/models/m/champion: damaged: not valid JSON"], "run the repair")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.problems == error.problems and isinstance(copy, ValueError)
