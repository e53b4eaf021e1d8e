"""The ``format`` checks run on every output after decoding: jsonschema's, corrected where they
disagree with the standard's own definitions.

jsonschema's ``FormatChecker`` (with its ``format-nongpl`` checkers) is the base. The JSON
Schema Test Suite's format files found these of its checks looser or stricter than the RFCs
they name, so they are replaced here, each by the RFC's rule:

- ``time`` and ``date-time`` (RFC 3339): a leap second (``:60``) is valid at 23:59 UTC, after
  the offset; the base refuses every leap second.
- ``email`` and ``idn-email`` (RFC 5321, 6531): the mailbox grammar; the base asks for an ``@``.
- ``hostname`` (RFC 1123, 5890): an A-label (``xn--``) must decode to a valid U-label; the base
  checks only the letters.
- ``idn-hostname`` (RFC 5890-5893): no trailing dot, and the bidi rule for every label of a
  domain holding a right-to-left label.
- ``relative-json-pointer`` (draft-handrews-relative-json-pointer): ASCII digits only.
- ``uri-template`` (RFC 6570): its grammar; the base accepts most text.
- ``regex`` (ECMA-262, as the standard says): the ``regress`` engine, where the base used
  Python's own syntax.
- ``uri``, ``uri-reference``, ``iri``, ``iri-reference``: an IPv6 literal host is an IPv6
  address (no leading zero in an embedded IPv4 part); an IRI is checked as the URI it maps to,
  where the base refused compressed IPv6 hosts and characters outside the basic plane.

docs/constraints.md lists which formats the grammar enforces while decoding and which only
this check does.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import unicodedata
from typing import Any

import jsonschema

_TIME = re.compile(r"(\d\d):(\d\d):(\d\d)(\.\d+)?([Zz]|([+-])(\d\d):(\d\d))\Z", re.ASCII)  # RFC 3339 digits are ASCII
_DATE = re.compile(r"(\d{4})-(\d\d)-(\d\d)\Z", re.ASCII)
_RELATIVE_POINTER = re.compile(r"(0|[1-9][0-9]*)(#|(/([^/~]|~[01])*)*)\Z")
# RFC 6570 section 2: literals, and expressions of an optional operator and varspecs.
_PCT = r"%[0-9A-Fa-f]{2}"
_VARCHAR = rf"(?:[A-Za-z0-9_]|{_PCT})"
_VARSPEC = rf"{_VARCHAR}(?:\.?{_VARCHAR})*(?::[1-9][0-9]{{0,3}}|\*)?"
_EXPRESSION = rf"\{{[+#./;?&=,!@|]?{_VARSPEC}(?:,{_VARSPEC})*\}}"
_LITERAL = r"[^\x00-\x20\"%<>\\^`{|}\x7f]"  # the apostrophe allowed, as the suite's tests say
_URI_TEMPLATE = re.compile(rf"(?:{_LITERAL}|{_PCT}|{_EXPRESSION})*\Z")
_IP_LITERAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#@]*@)?\[([^\]]*)\]|^//(?:[^/?#@]*@)?\[([^\]]*)\]")
_IDN_DOTS = (".", "\u3002", "\uff0e", "\uff61")
# RFC 5321 section 4.1.2 Mailbox (RFC 6531 adds characters past ASCII for idn-email).
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_QUOTED = r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"'
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_EMAIL = re.compile(rf"(?:{_ATEXT}+(?:\.{_ATEXT}+)*|{_QUOTED})@(?:{_LABEL}(?:\.{_LABEL})*|\[([^\]]*)\])\Z")
_IDN_EMAIL = re.compile(_EMAIL.pattern.replace("[A-Za-z0-9", "[A-Za-z0-9\u0080-\U0010ffff")
                        .replace("\\x5d-\\x7e]", "\\x5d-\\x7e\u0080-\U0010ffff]"))


def is_time(text: object) -> bool:
    """RFC 3339 ``full-time``, leap seconds at 23:59:60 UTC only."""
    if not isinstance(text, str):
        return True
    m = _TIME.match(text)
    if not m:
        return False
    hour, minute, second = int(m[1]), int(m[2]), int(m[3])
    if hour > 23 or minute > 59 or second > 60:
        return False
    if m[6]:
        off_h, off_m = int(m[7]), int(m[8])
        if off_h > 23 or off_m > 59:
            return False
        if second == 60:
            sign = 1 if m[6] == "+" else -1
            utc = (hour * 60 + minute - sign * (off_h * 60 + off_m)) % (24 * 60)
            return utc == 23 * 60 + 59
    return second < 60 or (hour, minute) == (23, 59)


def is_date(text: object) -> bool:
    """RFC 3339 ``full-date``: a real calendar day."""
    if not isinstance(text, str):
        return True
    m = _DATE.match(text)
    if not m:
        return False
    try:
        datetime.date(int(m[1]), int(m[2]), int(m[3]))
    except ValueError:
        return False
    return True


def is_date_time(text: object) -> bool:
    """RFC 3339 ``date-time``: a full date, ``T`` (either case), a full time."""
    if not isinstance(text, str):
        return True
    date, sep, time = text.partition("T") if "T" in text else text.partition("t")
    return bool(sep) and is_date(date) and is_time(time)


def is_hostname(text: object) -> bool:
    """RFC 1123 letters, digits and hyphens, with every A-label a valid IDNA label."""
    if not isinstance(text, str):
        return True
    if not _BASE.conforms(text, "hostname"):
        return False
    import idna

    for label in text.split("."):
        if label[:4].lower() == "xn--":
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError):
                return False
    return True


def is_idn_hostname(text: object) -> bool:
    """An internationalized hostname: the base check, no trailing dot, and RFC 5893's bidi rule
    on every label where one label is right to left."""
    if not isinstance(text, str):
        return True
    if not text or text.endswith(_IDN_DOTS) or not _BASE.conforms(text, "idn-hostname"):
        return False
    import idna

    labels = re.split("[" + "".join(_IDN_DOTS) + "]", text)
    if any(unicodedata.bidirectional(ch) in ("R", "AL", "AN") for label in labels for ch in label):
        try:
            for label in labels:
                idna.check_bidi(label, check_ltr=True)
        except idna.IDNABidiError:
            return False
    return True


def _is_mailbox(text: object, grammar: re.Pattern) -> bool:
    if not isinstance(text, str):
        return True
    m = grammar.match(text)
    if not m:
        return False
    literal = m[1]
    if literal is None:
        return True
    try:  # an address literal: an IPv4 address, or "IPv6:" and an IPv6 address
        if literal.startswith("IPv6:"):
            ipaddress.IPv6Address(literal[5:])
        else:
            ipaddress.IPv4Address(literal)
    except ValueError:
        return False
    return True


def is_email(text: object) -> bool:
    """RFC 5321's mailbox: a dot-string or quoted local part, ``@``, a domain or address literal."""
    return _is_mailbox(text, _EMAIL)


def is_idn_email(text: object) -> bool:
    """RFC 6531's mailbox: ``email`` with characters past ASCII allowed in names."""
    return _is_mailbox(text, _IDN_EMAIL)


def is_relative_json_pointer(text: object) -> bool:
    """A non-negative ASCII integer, then ``#`` or a JSON pointer."""
    return not isinstance(text, str) or bool(_RELATIVE_POINTER.match(text))


def is_uri_template(text: object) -> bool:
    """RFC 6570's grammar, level 4."""
    return not isinstance(text, str) or bool(_URI_TEMPLATE.match(text))


def is_ecma_regex(text: object) -> bool:
    """An ECMA-262 regular expression (with the ``u`` flag), as the standard defines ``regex``."""
    if not isinstance(text, str):
        return True
    import regress

    try:
        regress.Regex(text, "u")
    except regress.RegressError:
        return False
    return True


def _with_ip_literal(name: str, as_uri: str | None = None):
    """The base check of ``name`` (or, for an IRI, of ``as_uri`` on the URI it maps to: RFC 3987
    section 3.1) and, where the host is an IPv6 literal, a valid address."""

    def check(text: object) -> bool:
        if not isinstance(text, str):
            return True
        if any(ch <= " " or ch == "\x7f" for ch in text):  # a base check's "$" lets a final newline through
            return False
        if as_uri is not None:
            if not _BASE.conforms(_iri_to_uri(text), as_uri):
                return False
        elif not _BASE.conforms(text, name):
            return False
        m = _IP_LITERAL.match(text)
        host = m and (m[1] if m[1] is not None else m[2])
        if host and not host[:1] in ("v", "V"):  # IPvFuture has no address to check
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                return False
        return True

    return check


def _iri_to_uri(text: str) -> str:
    """RFC 3987's mapping: every character outside ASCII percent-encoded as its UTF-8 bytes."""
    return "".join(ch if ord(ch) < 128 else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
                   for ch in text)


_BASE = jsonschema.Draft202012Validator.FORMAT_CHECKER


def with_checks(base: jsonschema.FormatChecker, checks: dict[str, Any],
                raises: type[Exception] | tuple[type[Exception], ...] = ()) -> jsonschema.FormatChecker:
    """A copy of ``base`` with ``checks`` (format name -> predicate) replacing or adding its own."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    for name, check in checks.items():
        checker.checks(name, raises=raises)(check)
    return checker


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's draft 2020-12 format checks with the corrections above."""
    corrected = {"email": is_email, "idn-email": is_idn_email, "time": is_time, "date": is_date,
                 "date-time": is_date_time, "hostname": is_hostname, "idn-hostname": is_idn_hostname,
                 "relative-json-pointer": is_relative_json_pointer, "uri-template": is_uri_template,
                 "regex": is_ecma_regex,
                 "uri": _with_ip_literal("uri"), "uri-reference": _with_ip_literal("uri-reference"),
                 "iri": _with_ip_literal("iri", "uri"), "iri-reference": _with_ip_literal("iri-reference", "uri-reference")}
    return with_checks(_BASE, corrected)
