"""Held-out-style measurement of the repetition guard: N real schemas (JSONSchemaBench Glaiveai2K +
Github_easy, shuffled with seed 0), each asked for "a realistic example JSON object",
greedy, max_repeats=0 (guard off), 256 tokens; post hoc: where the guard (8) would have fired and
whether the unguarded output ended valid."""
import json, random, sys, time
import jsonschema
from pathlib import Path

#: JSONSchemaBench beside the checkout (../shared/data).
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"
from constrained_spec import load_model
from constrained_spec.constraint import compile_constraint
from constrained_spec.batching import BatchEngine
from constrained_spec.decoding import AdaptiveK
from constrained_spec.decoding.repetition import repeated_cycle
from constrained_spec.drafters import build_drafter
h = load_model()
rows = []
for name in ("Glaiveai2K", "Github_easy"):
    for line in open(DATA / f"{name}.jsonl"):
        rows.append((name, json.loads(line)))
random.Random(0).shuffle(rows)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 30
eng = BatchEngine(h.model, max_batch=16)
reqs = []
for name, row in rows:
    if len(reqs) >= N: break
    schema = row.get("json_schema", row.get("schema", row))
    if isinstance(schema, str): schema = json.loads(schema)
    try:
        c = compile_constraint(schema, h.vocabulary, backend="llguidance")
    except Exception:
        continue
    prompt = h.tokenizer.apply_chat_template([{"role": "user", "content": "Give a realistic example JSON object for this JSON schema:\n" + json.dumps(schema)[:3000]}], add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list): prompt = prompt["input_ids"]
    if len(prompt) > 1500: continue
    m = c.matcher()
    reqs.append((schema, c, eng.submit(prompt, m, drafter=build_drafter("auto", m, h.tokenizer), k_policy=AdaptiveK(8, costly_draft=False), max_new_tokens=256, max_repeats=0)))
t = time.time(); list(eng.run()); print("seconds", round(time.time() - t, 1))
fired = fired_valid = valid = 0
for schema, c, r in reqs:
    toks = r.result.tokens
    m = c.matcher(); states = []
    at = None
    for i, tok in enumerate(toks):
        m.advance([tok]); states.append(m.state)
        if at is None and repeated_cycle(toks[: i + 1], states, 8, m) is not None:
            at = i + 1
    ok = False
    if r.result.finished:
        try:
            jsonschema.validate(json.loads(h.tokenizer.decode(toks)), schema); ok = True
        except Exception:
            ok = False
    valid += ok
    if at is not None:
        fired += 1; fired_valid += ok
        print("fired at", at, "of", len(toks), "valid" if ok else "not valid", repr(h.tokenizer.decode(toks[max(0, at - 40):at]))[:120])
print(f"tasks {len(reqs)} valid {valid} guard-would-fire {fired} of which ended valid {fired_valid}")
