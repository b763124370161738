"""Incremental detokenization and stop strings: spans across tokens, no partial leaks."""

from wllm.engine.stop_checker import TextState
from wllm.sampling_params import SamplingParams


class ByteTokenizer:
    """Token i decodes to the bytes in `pieces[i]`; invalid UTF-8 shows as U+FFFD like HF."""

    byte_fallback_ids = frozenset()
    all_special_ids = frozenset()

    def __init__(self, pieces):
        self.pieces = [p.encode() if isinstance(p, str) else p for p in pieces]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def feed(pieces, tokens, **params):
    tok = ByteTokenizer(pieces)
    state = TextState(tok, [], SamplingParams(**params))
    seen = []
    hit = None
    for n, t in enumerate(tokens, 1):
        hit = state.append(t, n)
        seen.append(state.visible_text(False))
        if hit:
            break
    return state, seen, hit


PIECES = ["x", "xa", "b", "cd", "a", "z", "é"[:1], b"\xc3", b"\xa9", "END"]


def test_stop_string_spanning_three_tokens_is_cut_and_never_leaks():
    state, seen, hit = feed(PIECES, [1, 2, 3], stop=["abc"])
    assert seen == ["x", "x", "x"]
    assert hit == "abc" and state.text == "x"


def test_include_stop_string_in_output():
    state, _, hit = feed(PIECES, [1, 2, 3], stop=["abc"], include_stop_str_in_output=True)
    assert hit == "abc" and state.text == "xabc"


def test_held_back_prefix_is_released_when_it_stops_matching():
    state, seen, hit = feed(PIECES, [4, 2, 5], stop=["abc"])
    assert seen == ["", "", "abz"]
    assert hit is None
    assert state.visible_text(True) == "abz"


def test_earliest_of_several_stop_strings_wins():
    state, _, hit = feed(["ab", "cdef"], [0, 1], stop=["def", "bc"])
    assert hit == "bc" and state.text == "a"


def test_stop_strings_are_ignored_before_min_tokens():
    state, _, hit = feed(["a", "b", "a", "b"], [0, 1, 2, 3], stop=["ab"], min_tokens=3)
    assert hit == "ab" and state.text == "ab"


def test_multibyte_character_split_across_tokens_is_emitted_whole():
    state, seen, _ = feed(PIECES, [0, 7, 8, 0])
    assert seen == ["x", "x", "xé", "xéx"]


def test_finished_text_is_whole_and_flush_emits_trailing_bytes():
    tok = ByteTokenizer(PIECES)
    state = TextState(tok, [], SamplingParams(stop=["END"]))
    state.append(0, 1)
    state.append(4, 2)
    assert state.visible_text(False) == "xa"  # no tail of "xa" can start "END"
    state.append(7, 3)  # half of a two-byte character: held until more bytes come
    assert state.text == "xa"
    state.flush()
    assert state.visible_text(True) == "xa\ufffd"


def test_tokens_without_text_are_skipped():
    tok = ByteTokenizer(PIECES)
    state = TextState(tok, [], SamplingParams())
    state.append(0, 1)
    assert state.append(9, 2, decode_token=False) is None
    assert state.text == "x"
