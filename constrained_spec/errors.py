"""Errors raised by constrained_spec. Every message says what was expected, what came, and how to fix it."""

from __future__ import annotations


class ConstrainedSpecError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidSchemaError(ConstrainedSpecError, ValueError):
    """The schema is refused: it is not a valid JSON schema, could not be read, is over a limit,
    or no value satisfies it. Every refusal of a schema is one (``UnsupportedSchemaFeatureError``
    for a valid schema the backend cannot enforce), and its message says which it is and what
    ``lenient=True`` would do."""


class UnsupportedSchemaFeatureError(InvalidSchemaError):
    """The schema is valid, but uses a keyword the constraint backend cannot enforce.

    Attributes:
        keyword: the JSON Schema keyword, e.g. ``"uniqueItems"``.
        path: JSON pointer to the sub-schema holding it, e.g. ``"/properties/tags"``.
        relaxable: whether ``lenient=True`` compiles the schema with this keyword relaxed (checked
            after decoding instead); the message then says so.
    """

    #: What the message says of ``lenient=True`` when the caller does not say more.
    NOT_RELAXED = "lenient=True does not relax it on this backend: remove the keyword or check it after generation."

    def __init__(self, keyword: str, path: str, detail: str = "", *, lenient: str = NOT_RELAXED,
                 relaxable: bool = False) -> None:
        self.keyword = keyword
        self.path = path or "/"
        self.relaxable = relaxable
        msg = (
            f"Unsupported schema feature: the schema is valid, but keyword {keyword!r} at {self.path} cannot be "
            "enforced by the constraint, so outputs could violate it."
        )
        if detail:
            msg += f" {detail}"
        if lenient:
            msg += f" {lenient}"
        super().__init__(msg)


class InvalidRegexError(ConstrainedSpecError, ValueError):
    """The regular expression does not compile, or no token sequence can match it."""


class InvalidOptionError(ConstrainedSpecError, ValueError):
    """A decoding or compile option has a bad value or an unknown name (see ``SpecOptions``)."""


class InvalidTokenizerError(ConstrainedSpecError, ValueError):
    """The tokenizer cannot be used (for example, it has no EOS token)."""


class InvalidPromptError(ConstrainedSpecError, ValueError):
    """The prompt is empty or does not fit the model's context."""


class TokenizerMismatchError(ConstrainedSpecError, ValueError):
    """The draft model's tokenizer differs from the target's."""


class ConstraintViolationError(ConstrainedSpecError, ValueError):
    """A token was committed to a matcher where the constraint does not allow it."""


class DeadEndError(ConstrainedSpecError, RuntimeError):
    """The constraint reached a state that allows no token at all, not even EOS: the grammar
    has a dead end (a backend defect or a schema whose language is empty past this point)."""

    def __init__(self, partial_text: str, output_tokens: int) -> None:
        self.partial_text = partial_text
        super().__init__(
            f"The constraint reached a state where no token is allowed (a dead end of the grammar) after "
            f"{output_tokens} output tokens; simplify the schema or pattern, or try the other backend. "
            f"Partial output: {partial_text!r}"
        )


class KVMemoryError(ConstrainedSpecError, ValueError):
    """A request whose KV cache alone would exceed the batch engine's memory bound."""


class ModelLoadError(ConstrainedSpecError, RuntimeError):
    """A model could not be loaded (missing package, bad path, bad argument)."""


class TokenLimitError(ConstrainedSpecError, RuntimeError):
    """``max_new_tokens`` ran out before the constraint was satisfied.

    Attributes:
        partial_text: the text generated so far (a valid prefix of the language).
        max_new_tokens: the limit that was reached.
    """

    def __init__(self, partial_text: str, max_new_tokens: int) -> None:
        self.partial_text = partial_text
        self.max_new_tokens = max_new_tokens
        super().__init__(
            f"Generation stopped at max_new_tokens={max_new_tokens} before the output was complete; "
            f"raise max_new_tokens. Partial output: {partial_text!r}"
        )


class RepetitionError(TokenLimitError):
    """The output kept repeating one token cycle with the constraint back in the same state, so
    decoding stopped early (the repetition guard, option ``max_repeats``; 0 turns it off).

    Attributes:
        partial_text: the text generated so far (a valid prefix of the language).
        cycle: the repeated text.
        repeats: how many copies of it ended the output.
    """

    def __init__(self, partial_text: str, cycle: str, repeats: int) -> None:
        self.cycle = cycle
        self.repeats = repeats
        ConstrainedSpecError.__init__(
            self,
            f"Generation stopped: the output repeated {cycle!r} {repeats} times with the constraint in the same "
            f"state (a loop that would run to the token limit); raise or disable it with max_repeats (0 = off). "
            f"Partial output: {partial_text[-200:]!r}",
        )
        self.partial_text = partial_text
        self.max_new_tokens = 0


class OutputValidationError(ConstrainedSpecError, RuntimeError):
    """The finished output failed validation against the original schema (never returned silently)."""

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason
        super().__init__(f"Generated output does not validate against the schema: {reason}. Output: {text!r}")
