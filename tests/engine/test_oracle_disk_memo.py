"""The oracle's uncached forwards kept between runs (``oracle.DiskMemo``): a second process reads them instead of
running the forward, and a corrupt, stale or mismatched entry is rebuilt, never trusted."""

import glob
import os

import torch

from kvconform import zoo
from kvconform.oracle import Oracle


def _entries(folder):
    return sorted(glob.glob(os.path.join(folder, "oracle", "*", "*", "*.pt")))


def _tokens():
    return torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def test_entries_are_written_in_the_cache_folder_and_read_back_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCONFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCONFORM_CACHE", "on")
    zm = zoo.build_zoo_model("llama")
    first = Oracle(zm).logits(_tokens())
    assert len(_entries(tmp_path)) == 1
    again = Oracle(zm)  # a new oracle (a new run): reads the entry, no forward
    calls = []
    monkeypatch.setattr(again, "_forward", lambda *a: calls.append(a))
    assert torch.equal(again.logits(_tokens()), first) and not calls


def test_a_corrupt_entry_is_deleted_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCONFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCONFORM_CACHE", "on")
    zm = zoo.build_zoo_model("llama")
    right = Oracle(zm).logits(_tokens())
    (path,) = _entries(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF  # one flipped byte in the payload: the checksum no longer matches
    open(path, "wb").write(bytes(data))
    assert torch.equal(Oracle(zm).logits(_tokens()), right)
    open(path, "wb").write(b"short")  # a truncated write
    assert torch.equal(Oracle(zm).logits(_tokens()), right)
    assert open(path, "rb").read() != b"short"  # rebuilt


def test_changed_weights_or_versions_never_read_an_old_entry(tmp_path, monkeypatch):
    """The key holds the weights' digest (a subject that changed the shared model in place, or another zoo build)
    and the versions: another model state or release writes its own entry."""
    monkeypatch.setenv("KVCONFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCONFORM_CACHE", "on")
    zm = zoo.build_zoo_model("llama")
    oracle = Oracle(zm)
    before = oracle.uncached(_tokens())
    with torch.no_grad():
        next(zm.model.parameters()).add_(1.0)  # in place: torch's version counter moves
    after = Oracle(zm).uncached(_tokens())
    assert not torch.equal(before, after) and len(_entries(tmp_path)) == 2
    from kvconform import oracle as oracle_module

    monkeypatch.setattr(oracle_module, "_versions", lambda: ("0.0", "0.0", "0.0", "x"))
    Oracle(zm).uncached(_tokens())
    assert len(_entries(tmp_path)) == 3


def test_the_cache_is_on_unless_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCONFORM_CACHE_DIR", str(tmp_path))
    zm = zoo.build_zoo_model("llama")
    monkeypatch.setenv("KVCONFORM_CACHE", "off")
    Oracle(zm).logits(_tokens())
    assert _entries(tmp_path) == []
    monkeypatch.delenv("KVCONFORM_CACHE")
    Oracle(zm).logits(_tokens())
    assert len(_entries(tmp_path)) == 1


def test_the_releases_used_last_are_kept_and_older_ones_deleted(tmp_path, monkeypatch):
    """Entries live in one folder per release (versions of torch, transformers, kvconform); a run keeps its own and
    the RELEASES_KEPT - 1 used most recently before it, and deletes the rest."""
    from kvconform import oracle as oracle_module

    monkeypatch.setenv("KVCONFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCONFORM_CACHE", "on")
    zm = zoo.build_zoo_model("llama")
    releases = []
    for n in range(oracle_module.RELEASES_KEPT + 2):
        oracle_module.release_folder.cache_clear()  # a new process
        monkeypatch.setattr(oracle_module, "_versions", lambda n=n: ("0.0", "0.0", "0.0", f"release-{n}"))
        Oracle(zm).logits(_tokens())
        releases.append(oracle_module.release_folder(str(tmp_path)))
        os.utime(releases[-1], (1_000_000 + n, 1_000_000 + n))  # used in this order
    oracle_module.release_folder.cache_clear()
    kept = sorted(os.listdir(tmp_path / "oracle"))
    assert kept == sorted(os.path.basename(r) for r in releases[-oracle_module.RELEASES_KEPT:])
    oracle_module.release_folder.cache_clear()
