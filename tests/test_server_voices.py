"""The voice store on a real directory: atomic writes, validation, persistence across instances."""

import numpy as np
import pytest

from serving.api.voices import VoiceError, VoiceStore, normalize_name


def clip(seconds=1.5):
    return (0.1 * np.sin(np.arange(int(24000 * seconds)) / 7)).astype(np.float32)


def test_add_get_list_delete_and_survive_a_restart(tmp_path):
    store = VoiceStore(tmp_path, reserved=("vivian",))
    meta = store.add_audio("Alice", clip(), source_bytes=1234, mime_type="audio/wav", ref_text="hello", consent="yes")
    assert meta["name"] == "alice" and meta["duration_s"] == 1.5 and meta["file_size"] == 1234
    store.add_embedding("bob", np.arange(4, dtype=np.float32), ref_text=None, consent="ok")
    again = VoiceStore(tmp_path, reserved=("vivian",))
    assert [m["name"] for m in again.list()] == ["alice", "bob"]
    alice = again.get("ALICE")
    assert alice.ref_text == "hello" and np.abs(alice.audio - clip()).max() < 1e-4 and alice.embedding is None
    assert again.get("bob").embedding.tolist() == [0, 1, 2, 3]
    assert again.delete("alice") and not again.delete("alice")
    assert again.get("alice") is None and VoiceStore(tmp_path).names() == ["bob"]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".hidden", "x" * 65, "a..b", "name with space", "é"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(VoiceError):
        normalize_name(name)


def test_duplicates_reserved_names_and_stale_temp_dirs(tmp_path):
    store = VoiceStore(tmp_path, reserved=("vivian",))
    store.add_audio("a", clip(), source_bytes=1, mime_type="audio/wav", ref_text=None, consent="y")
    with pytest.raises(VoiceError) as info:
        store.add_audio("A", clip(), source_bytes=1, mime_type="audio/wav", ref_text=None, consent="y")
    assert info.value.status == 409
    with pytest.raises(VoiceError):
        store.add_audio("Vivian", clip(), source_bytes=1, mime_type="audio/wav", ref_text=None, consent="y")
    (tmp_path / ".tmp-crashed").mkdir()
    assert VoiceStore(tmp_path).names() == ["a"] and not (tmp_path / ".tmp-crashed").exists()
    assert store.get("../a") is None


def test_a_recreated_voice_gets_a_new_cache_key(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path)
    store.add_audio("a", clip(), source_bytes=1, mime_type="audio/wav", ref_text=None, consent="y")
    key = store.get("a").key
    store.delete("a")
    import serving.api.voices as voices
    monkeypatch.setattr(voices.time, "time", lambda: 4_000_000_000)
    store.add_audio("a", clip(2.0), source_bytes=1, mime_type="audio/wav", ref_text=None, consent="y")
    assert store.get("a").key != key and len(store.get("a").audio) == 48000
