"""Subscription filters on message attributes, in the Google Cloud Pub/Sub filter syntax:

    attributes.KEY = "v"      attributes.KEY != "v"      attributes:KEY      hasPrefix(attributes.KEY, "p")
    NOT x      -x      x AND y      x OR y      ( x )

KEY is a name of letters, digits, `_` and `-`, or any name as a quoted string (`attributes."a b"`).
`-` is Google's other spelling of NOT. NOT binds tightest, then AND, then OR. Google refuses a filter
that mixes AND and OR without parentheses, and its own emulator (on AIP-160's grammar) binds OR
before AND, so such a filter is refused here too; one stored before that rule keeps this reading
(`mixed=True`). Parsed by
lark (an LALR grammar), compiled once into nested closures: evaluating a message costs a few
dictionary lookups.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedInput, VisitError

Predicate = Callable[[Mapping[str, str]], bool]

_GRAMMAR = r"""
?start: or_expr
?or_expr: and_expr (_OR and_expr)*      -> any_of
?and_expr: unary (_AND unary)*          -> all_of
?unary: (_NOT | _MINUS) unary           -> negate
      | atom
?atom: "(" or_expr ")"                   -> group
     | "attributes" "." key "=" STRING   -> equals
     | "attributes" "." key "!=" STRING  -> differs
     | "attributes" ":" key              -> has
     | "hasPrefix" "(" "attributes" "." key "," STRING ")" -> has_prefix
key: NAME | STRING
_OR: "OR"
_AND: "AND"
_NOT: "NOT"
_MINUS: "-"
NAME: /[A-Za-z0-9_-]+/
STRING: /"(?:[^"\\]|\\.)*"/
%import common.WS
%ignore WS
"""

_PARSER = Lark(_GRAMMAR, parser="lalr", maybe_placeholders=False, propagate_positions=True)
MAX_LENGTH = 256  # Google's limit on a filter's length


class FilterError(ValueError):
    """A filter that does not parse; the message names the position (1-based column)."""


# The escapes Google's filter strings take (as CEL's): the usual single characters, and Unicode,
# hexadecimal and octal code points. A JSON surrogate pair (`\ud83d\ude00`) is one code point: filters
# stored before these escapes were read as JSON strings, and must read the same.
_ESCAPE = re.compile(r'\\(?:([abfnrtv\\\'"?/`])|x([0-9A-Fa-f]{2})|([0-3][0-7]{2})'
                     r"|u([Dd][89ABab][0-9A-Fa-f]{2})\\u([Dd][C-Fc-f][0-9A-Fa-f]{2})"
                     r"|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|(.))", re.DOTALL)
_SINGLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _escaped(found: re.Match[str]) -> str:
    single, hexadecimal, octal, high, low, short, long, invalid = found.groups()
    if invalid is not None:
        raise ValueError(f"invalid escape \\{invalid}")
    if single is not None:
        return _SINGLE.get(single, single)
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00))
    code = int(hexadecimal, 16) if hexadecimal else int(octal, 8) if octal else int(short or long, 16)
    if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        raise ValueError(f"invalid code point {code:#x}")
    return chr(code)


def _unquote(token: str) -> str:
    if token.startswith('"'):
        return _ESCAPE.sub(_escaped, token[1:-1])
    return token


@v_args(inline=True)
class _Compile(Transformer[Token, Predicate]):
    def key(self, token: Token) -> str:
        return _unquote(str(token))

    def equals(self, key: str, value: Token) -> Predicate:
        expected = _unquote(str(value))
        return lambda attributes: attributes.get(key) == expected

    def differs(self, key: str, value: Token) -> Predicate:
        # Google: `!=` holds for a message without the attribute too.
        expected = _unquote(str(value))
        return lambda attributes: attributes.get(key) != expected

    def has(self, key: str) -> Predicate:
        return lambda attributes: key in attributes

    def has_prefix(self, key: str, prefix: Token) -> Predicate:
        start = _unquote(str(prefix))
        return lambda attributes: attributes.get(key, None) is not None and attributes[key].startswith(start)

    def group(self, inner: Predicate) -> Predicate:
        return inner

    def negate(self, inner: Predicate) -> Predicate:
        return lambda attributes: not inner(attributes)

    def all_of(self, *parts: Predicate) -> Predicate:
        return lambda attributes: all(p(attributes) for p in parts)

    def any_of(self, *parts: Predicate) -> Predicate:
        return lambda attributes: any(p(attributes) for p in parts)


@dataclass(frozen=True)
class Filter:
    """A parsed filter: `matches(attributes)`; equal when their texts are."""

    text: str
    _predicate: Predicate = field(compare=False, repr=False)
    mixed_at: int | None = field(default=None, compare=False)  # column of AND meeting OR unparenthesised

    def matches(self, attributes: Mapping[str, str]) -> bool:
        return self._predicate(attributes)


MIXED = "mixes AND and OR without parentheses at column {}: write (a AND b) OR c, or a AND (b OR c)"


def _mixed_at(tree: Tree[Token]) -> int | None:
    """The column of the first AND group that is an operand of OR without parentheses, or None."""
    # (One-operand AND and OR nodes wrap every term.)
    for node in tree.iter_subtrees_topdown():  # type: ignore[no-untyped-call]
        if node.data == "any_of" and len(node.children) > 1:
            for child in node.children:
                if isinstance(child, Tree) and child.data == "all_of" and len(child.children) > 1:
                    return int(child.meta.column)
    return None


def parse_filter(text: str, mixed: bool = False) -> Filter:
    """The filter `text`; one that mixes AND and OR without parentheses only with `mixed` (a filter
    stored before that was refused: it keeps the reading NOT, then AND, then OR)."""
    if len(text) > MAX_LENGTH:
        raise FilterError(f"must be at most {MAX_LENGTH} characters (got {len(text)})")
    if not text.strip():
        raise FilterError("must not be empty (leave `filter` out to deliver every message)")
    try:
        tree = _PARSER.parse(text)
        predicate = _Compile().transform(tree)
    except UnexpectedInput as e:
        near = text[e.column - 1:e.column + 14] if e.column > 0 else ""
        raise FilterError(f"syntax error at column {e.column}" + (f" near {near!r}" if near else "")
                          + ' (expected e.g. attributes.KEY = "v", attributes:KEY, '
                            'hasPrefix(attributes.KEY, "p"), NOT or -, AND, OR, parentheses)') from None
    except (VisitError, ValueError):
        raise FilterError("a quoted string has an invalid escape (\\\" \\\\ \\n \\t, \\xHH, \\ooo, \\uHHHH "
                          "and \\UHHHHHHHH are known)") from None
    mixed_at = _mixed_at(tree)
    if mixed_at is not None and not mixed:
        raise FilterError(MIXED.format(mixed_at))
    return Filter(text, predicate, mixed_at)
