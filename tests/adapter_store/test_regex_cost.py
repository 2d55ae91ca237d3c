"""count_repeats: a user regex's repetitions read from its text, as ``re`` itself parses it."""

from __future__ import annotations

import re

import pytest

from services.adapter_store.regex_cost import UnboundedRegex, count_repeats


@pytest.mark.parametrize(
    "pattern, repeats",
    [
        (r".*\.self_attn\.(q|k|v|o)_proj", 1),
        (r"model\.layers\.\d+\.mlp\..*", 2),
        (r"a?b{1}c{0,1}", 0),  # at most once is no repetition
        (r"a{2}b{,3}c{2,}d{,}", 4),
        (r"a{}b{x}", 0),  # braces that are not a quantifier are characters
        (r"a(?#note)+", 1),  # a quantifier after a comment repeats what precedes it
        (r"(?:a)*[]x]+\x41*\101+", 4),  # one character, however written, may repeat
        (r"(?:.*)?(?=\w+)", 2),  # repetitions inside groups and lookarounds count
        (r"(a)\1?", 0),
    ],
)
def test_repetitions_are_counted(pattern, repeats):
    assert count_repeats(pattern) == repeats


@pytest.mark.parametrize(
    "pattern",
    [r"(.*.*)*y", r"(.|.)*y", r"(?:a|b)*", r"(?:ab)+", r"(a)\1+", r"(?>a)*", r"(?:(?:a))*", r"(?=a){2}"],
)
def test_a_repeated_group_is_refused(pattern):
    with pytest.raises(UnboundedRegex, match="repeats a group"):
        count_repeats(pattern)


@pytest.mark.parametrize("pattern", [r"(?x)a *", r"(?x:a | ab)*"])
def test_verbose_syntax_is_refused(pattern):
    with pytest.raises(UnboundedRegex, match="verbose"):
        count_repeats(pattern)


def test_an_invalid_regex_raises_re_error():
    with pytest.raises(re.error):
        count_repeats("(unclosed")
