"""Stop strings on decoded text: the rule the engine and the ingress's detokenizer share."""

from __future__ import annotations

from outrider.target_worker.stop_strings import find_stop, held_back


def test_find_stop_takes_the_earliest_match_past_the_checked_prefix():
    assert find_stop("abc END x STOP", ["STOP", "END"]) == (4, "END")
    assert find_stop("abc", ["END"]) is None
    assert find_stop("abc", []) is None
    # A match must end past `checked`: "END" at 0 lies in the checked prefix, "EN|D" spans it.
    assert find_stop("END..END", ["END"], checked=5) == (5, "END")
    assert find_stop("xxEND", ["END"], checked=4) == (2, "END")


def test_held_back_is_the_longest_suffix_that_may_become_a_stop():
    assert held_back("abcEN", ["END"]) == 2
    assert held_back("abcE", ["END", "xyz"]) == 1
    assert held_back("abcEN", ["NOPE", "ENDS"]) == 2  # "EN" of "ENDS" beats "N" of "NOPE"
    assert held_back("abc", ["END"]) == 0
    assert held_back("", ["END"]) == 0
