"""JSON-schema-constrained generation from a schema file, streamed as it is accepted.

Run: python examples/schema_file.py
Or: constrained-spec json schemas/invoice.json --stream --stats --prompt "$(cat examples/invoice.txt)"
"""

from pathlib import Path

from constrained_spec import generate_json

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    prompt = "Extract the invoice as JSON.\n\n" + (ROOT / "examples" / "invoice.txt").read_text()
    stream = generate_json(None, ROOT / "schemas" / "invoice.json", prompt, stream=True)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    print("validated:", stream.value)
    print(f"{stream.stats.tokens_per_second:.1f} tok/s, {stream.stats.forwards_per_token:.2f} target forwards per token")
