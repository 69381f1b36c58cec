"""StopStringMatcher: the same emitted text and matched stop under every chunking of the text."""

from __future__ import annotations

import random

import pytest

from inference_service.engine.stop_checker import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Scans the text one character at a time: the first stop to complete wins; among stops
    completing at the same character, the longest."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


def reference_holdback(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])),
               default=0)


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run(stops: list[str], chunks: list[str], check_holdback: bool = True) -> tuple[str, str | None]:
    """Feeds chunks; checks after each feed that exactly the unambiguous text was emitted."""
    matcher = StopStringMatcher(stops)
    emitted, fed = "", ""
    for chunk in chunks:
        fed += chunk
        out, stop = matcher.feed(chunk)
        emitted += out
        if stop is not None:
            assert matcher.feed("more text") == ("", None) and matcher.flush() == ""
            return emitted, stop
        if check_holdback:
            assert emitted == fed[: len(fed) - reference_holdback(fed, stops)], (fed, emitted)
    return emitted + matcher.flush(), None


def chunkings(rng: random.Random, text: str) -> list[list[str]]:
    return [[text], list(text), [""] + list(text) + [""]] + [random_chunks(rng, text) for _ in range(20)]


CASES = [
    (["abc", "bcd"], "xxabcdyy", ("xx", "abc")),
    (["bcd", "abc"], "xxabcdyy", ("xx", "abc")),
    (["bc", "abcd"], "abcd", ("a", "bc")),  # the shorter stop completes first
    (["abc", "bc"], "zabc!", ("z", "abc")),  # same end: the longer one
    (["Hello"], "Hello world", ("", "Hello")),  # stop at the very start
    (["aab"], "aaab tail", ("a", "aab")),
    (["\n\nUser:"], "The answer is 4.\n\nUser: and more", ("The answer is 4.", "\n\nUser:")),
    (["\n\nUser:"], "ends with a partial \n\nUse", ("ends with a partial \n\nUse", None)),
    (["停止", "🛑"], "一些文字🛑之后", ("一些文字", "🛑")),
    (["停止", "🛑"], "一些文字停止", ("一些文字", "停止")),
    (["x"], "", ("", None)),
    (["ab", "ab"], "cab", ("c", "ab")),
]


@pytest.mark.parametrize("stops, text, want", CASES)
def test_cases_under_all_chunkings(stops, text, want):
    assert reference(text, stops) == want
    rng = random.Random()
    for chunks in chunkings(rng, text):
        assert run(stops, chunks) == want, chunks


@pytest.mark.parametrize("trial", range(200))
def test_random_overlapping_stops(trial):
    rng = random.Random()
    alphabet = rng.choice(["ab", "abc", "a😀b"])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
    want = reference(text, stops)
    for chunks in chunkings(rng, text):
        assert run(stops, chunks) == want, (stops, chunks)


def test_no_stops_pass_through_without_holdback():
    matcher = StopStringMatcher([])
    for delta in ["Hel", "lo", "", " wor", "ld\n"]:
        assert matcher.feed(delta) == (delta, None)
    assert matcher.flush() == ""


def test_flush_releases_only_held_text_once():
    matcher = StopStringMatcher(["</s>", "STOP"])
    assert matcher.feed("abc <") == ("abc ", None)
    assert matcher.feed("/") == ("", None)
    assert matcher.feed("x S") == ("</x ", None)
    assert matcher.flush() == "S"
    assert matcher.flush() == ""


def test_text_after_stop_is_dropped():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("one E") == ("one ", None)
    assert matcher.feed("ND two") == ("", "END")
    assert matcher.is_finished and matcher.matched == "END"
    assert matcher.feed("three") == ("", None)
    assert matcher.flush() == ""


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
