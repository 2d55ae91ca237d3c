"""What matching a user-supplied regex may cost: its repetitions, counted from the pattern's text.

An adapter's config may give ``target_modules``, ``exclude_modules`` and pattern keys as regexes,
which ``re`` matches against module paths by backtracking: each repetition (``.*``, ``\\d+``)
multiplies the worst-case cost by a path's length, and a repeated group (``(a|ab)*``, ``(.*)*``)
can make it exponential. So a pattern may repeat only single characters or classes (``[ab]*``,
not ``(?:a|b)*``), and only a few times. The pattern is read here by a small scanner of Python's regex syntax (``re`` exposes
no parse tree), and only after ``re.compile`` has accepted it, so the scanner need not diagnose
malformed input.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Escapes that stand for one character of a class.
_CLASS_ESCAPES = frozenset("dDsSwW")
#: Escapes that match no character (a position), as ``^`` and ``$`` do.
_POSITION_ESCAPES = frozenset("AZbB")
_DIGITS = "0123456789"
_OCTAL_DIGITS = "01234567"
#: Hex digits of the escapes ``\x``, ``\u`` and ``\U``.
_HEX_LENGTHS = {"x": 2, "u": 4, "U": 8}


class UnboundedRegex(ValueError):
    """A pattern whose matching cost this module cannot bound: it repeats something longer than
    one character, or asks for verbose syntax (whose spaces and comments the scanner does not
    read). Its message says which, as the end of a sentence naming the pattern."""


def count_repeats(pattern: str) -> int:
    """How many unbounded or multiple repetitions ``pattern`` holds (``a?`` is none, ``a{2}``
    one). Raises ``re.error`` when it is not a valid regex and :class:`UnboundedRegex` when a
    repetition applies to more than one character or class."""
    re.compile(pattern)
    scanner = _Scanner(pattern)
    return sum(item.repeats for branch in scanner.alternation() for item in branch)


@dataclass(frozen=True)
class _Item:
    """One element of a sequence, with what repeating it would mean."""

    repeatable: bool
    """Repeating it is linear: one character or class, or a plain ``(?:...)`` holding one
    (which ``re`` unwraps before repeating it)."""
    one_char: bool
    """A single character or class itself, not quantified, not grouped."""
    repeats: int
    """Repetitions inside it, its own included."""


_CHAR = _Item(repeatable=True, one_char=True, repeats=0)
#: A position (``^``, ``\b``) or a backreference: no single character to repeat.
_NOT_A_CHAR = _Item(repeatable=False, one_char=False, repeats=0)


def _repeated(atom: _Item, most: float | None) -> _Item:
    """``atom`` under a quantifier repeating it at most ``most`` times (None: none)."""
    if most is None:
        return atom
    if most > 1 and not atom.repeatable:
        raise UnboundedRegex(
            "repeats a group; only single characters or classes may be repeated (like .* or \\d+), "
            "to keep matching fast"
        )
    return _Item(repeatable=False, one_char=False, repeats=atom.repeats + (most > 1))


class _Scanner:
    """Recursive descent over a pattern ``re`` compiles, in ``re``'s own grammar."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.at = 0

    def peek(self, offset: int = 0) -> str:
        """The character ``offset`` past the cursor; empty past the end."""
        index = self.at + offset
        return self.pattern[index] if index < len(self.pattern) else ""

    def next_is(self, chars: str, offset: int = 0) -> bool:
        """The character ``offset`` past the cursor is one of ``chars`` (never past the end)."""
        char = self.peek(offset)
        return char != "" and char in chars

    def alternation(self) -> list[list[_Item]]:
        """Branches up to the end or the ``)`` that closes the current group (left unread)."""
        branches = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.sequence())
        return branches

    def sequence(self) -> list[_Item]:
        items: list[_Item] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            if atom is None:  # a comment or flags: a quantifier after it repeats the item before
                if not items:
                    continue
                atom = items.pop()
            items.append(_repeated(atom, self.quantifier()))
        return items

    def atom(self) -> _Item | None:
        char = self.peek()
        if char == "\\":
            return self.escape()
        if char == "[":
            self.char_class()
            return _CHAR
        if char == "(":
            return self.group()
        self.at += 1
        return _NOT_A_CHAR if char in "^$" else _CHAR

    def escape(self) -> _Item:
        char = self.peek(1)
        self.at += 2
        if char in _CLASS_ESCAPES:
            return _CHAR
        if char in _POSITION_ESCAPES:
            return _NOT_A_CHAR
        if char in _HEX_LENGTHS:
            self.at += _HEX_LENGTHS[char]
        elif char == "N":
            self.at = self.pattern.index("}", self.at) + 1
        elif char == "0":
            self.at += self.next_is(_OCTAL_DIGITS) and 1 + self.next_is(_OCTAL_DIGITS, 1)
        elif char in _DIGITS:
            # As ``re`` reads it: three octal digits are a character, else one or two digits
            # are a backreference (a repeated one can backtrack like a group).
            second = self.peek()
            self.at += self.next_is(_DIGITS)
            if not (char in _OCTAL_DIGITS and second in _OCTAL_DIGITS and self.next_is(_OCTAL_DIGITS)):
                return _NOT_A_CHAR
            self.at += 1
        return _CHAR

    def char_class(self) -> None:
        """Past the ``]`` closing the class at ``[`` (a ``]`` first in it is a member)."""
        self.at += 1
        if self.peek() == "^":
            self.at += 1
        if self.peek() == "]":
            self.at += 1
        while (char := self.peek()) != "]":
            self.at += 2 if char == "\\" else 1
        self.at += 1

    def group(self) -> _Item | None:
        self.at += 1
        plain = False
        if self.peek() == "?":
            kind = self.peek(1)
            self.at += 2
            if kind == "#":  # a comment
                self.at = self.pattern.index(")", self.at) + 1
                return None
            if kind == "P" and self.peek() == "=":  # a backreference by name
                self.at = self.pattern.index(")", self.at) + 1
                return _NOT_A_CHAR
            if kind == "P":  # a named group
                self.at = self.pattern.index(">", self.at) + 1
            elif kind == "<":  # a lookbehind
                self.at += 1
            elif kind == "(":  # a conditional: its condition names a group
                self.at = self.pattern.index(")", self.at) + 1
            elif kind == ":":
                plain = True
            elif kind not in "=!>":  # inline flags, global ``(?i)`` or scoped ``(?i-s:...)``
                self.at -= 1
                flags_end = min(end for end in (self.pattern.find(c, self.at) for c in "):") if end >= 0)
                added = self.pattern[self.at : flags_end].partition("-")[0]
                if "x" in added:
                    raise UnboundedRegex("asks for verbose syntax (the x flag), which is not accepted")
                self.at = flags_end + 1
                if self.pattern[flags_end] == ")":
                    return None
        branches = self.alternation()
        self.at += 1  # the closing ")"
        repeats = sum(item.repeats for branch in branches for item in branch)
        # ``re`` repeats a plain group's one character as that character; anything else as a group.
        repeatable = plain and len(branches) == 1 and len(branches[0]) == 1 and branches[0][0].one_char
        return _Item(repeatable=repeatable, one_char=False, repeats=repeats)

    def quantifier(self) -> float | None:
        """The most times a quantifier at the cursor repeats (read past it, with its lazy or
        possessive suffix); None when there is none (a ``{`` that is not one is a character)."""
        char = self.peek()
        if char in ("*", "+"):
            self.at += 1
            most = math.inf
        elif char == "?":
            self.at += 1
            most = 1
        elif char == "{":
            match = _BOUNDS.match(self.pattern, self.at)
            if match is None or match[0] == "{}":
                return None
            self.at = match.end()
            low, comma, high = match.groups()
            most = int(high) if high else (math.inf if comma else int(low))
        else:
            return None
        self.at += self.next_is("?+")
        return most


#: A ``{m,n}`` quantifier as ``re`` reads one (either bound may be left out; ``{}`` is two characters).
_BOUNDS = re.compile(r"\{(\d*)(,?)(\d*)\}")
