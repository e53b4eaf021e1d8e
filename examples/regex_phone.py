"""Regex-constrained generation: the output always fully matches the pattern.

Run: python examples/regex_phone.py
Or: constrained-spec regex '\+?[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}' --prompt "Daniel Kim's number is +1 415 555 0199. His number:"
"""

from constrained_spec import generate_regex

PATTERN = r"\+?[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}"

if __name__ == "__main__":
    phone, stats = generate_regex(None, PATTERN, "Daniel Kim's number is +1 415 555 0199. Write his number:",
                                  return_stats=True)
    print(phone)
    print(f"{stats.output_tokens} tokens, {stats.target_forwards} target forwards, {stats.tokens_per_second:.1f} tok/s")
