"""The master's rendezvous store: c10d's semantics (those of torch's TCPStore) over a dict."""

from __future__ import annotations

from master.store import KeyValueStore


def test_set_get_add_and_check_behave_as_torchs_tcpstore():
    s = KeyValueStore()
    assert s.get("k") is None and not s.check(["k"])
    s.set("k", b"v")
    assert s.get("k") == b"v" and s.check(["k"]) and not s.check(["k", "other"])
    assert s.add("n", 1) == 1 and s.add("n", 0) == 1 and s.add("n", -3) == -2
    assert s.get("n") == b"-2" and len(s) == 2
    assert s.delete("k") and not s.delete("k") and len(s) == 1


def test_compare_set_sets_only_on_a_match_or_an_absent_key_with_an_empty_expectation():
    s = KeyValueStore()
    assert s.compare_set("k", b"x", b"y") == b"x" and s.get("k") is None  # absent, expected not empty
    assert s.compare_set("k", b"", b"first") == b"first"
    assert s.compare_set("k", b"wrong", b"second") == b"first"
    assert s.compare_set("k", b"first", b"second") == b"second" and s.get("k") == b"second"


def test_generations_before_the_last_two_are_forgotten_and_nothing_else():
    s = KeyValueStore()
    for key in ("gen1/arrived", "gen1/0", "gen2/arrived", "gen10/arrived", "general", "gen3x/a", "other/gen1"):
        s.set(key, b"1")
    assert s.forget_generations_before(2) == 2
    assert s.get("gen1/arrived") is None and s.get("gen2/arrived") == b"1" and s.get("gen10/arrived") == b"1"
    assert s.get("general") == s.get("gen3x/a") == s.get("other/gen1") == b"1"
