"""A head trained for a GGUF file lives in the cache under the file's identity: ``train-drafter
--target FILE`` without ``--out`` puts it there, and ``draft=True`` and auto find it for that file
(a copy of the same bytes included) without a path, drafting exactly."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from constrained_spec import generate_regex, load_model
from constrained_spec.api import resolve_draft
from constrained_spec.cli import app
from constrained_spec.decoding import SpecOptions
from constrained_spec.errors import InvalidOptionError
from constrained_spec.storage import model_file_identity, trained_head_dir
from tests.tiny_gguf import write_tiny_gguf

PATTERN = r"(yes|no|maybe), [a-z]{2,12} [0-9]{1,6}"
PROMPTS = ["Is the sky green? ", "Answer: ", "Is water wet? ", "Say a word: "]


@pytest.fixture()
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))  # heads and packed weights stay here
    shape = dict(arch="llama", types={"attn_q": "Q4_0"}, default="Q8_0", hidden=256, layers=2, ff=512, gpt2_vocab=2000)
    return write_tiny_gguf(tmp_path / "target.gguf", seed=0, **shape), write_tiny_gguf(tmp_path / "other.gguf", seed=1, **shape)


def test_train_drafter_without_out_keeps_the_head_where_draft_true_and_auto_find_it(files, tmp_path):
    target, other = files
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "regex": PATTERN}) + "\n" for p in PROMPTS))
    res = CliRunner().invoke(app, ["train-drafter", "--target", str(target), "--data", str(data), "--steps", "2",
                                   "--max-new-tokens", "16", "--draft-vocab", "64", "--batch", "1"])
    assert res.exit_code == 0, res.output
    home = trained_head_dir(target)
    assert json.loads(res.stdout[res.stdout.index("{"):])["out"] == str(home) and (home / "head.safetensors").is_file()

    handle = load_model(str(target))
    base = generate_regex(handle, PATTERN, PROMPTS[0], drafter="none", max_new_tokens=32)
    text, stats = generate_regex(handle, PATTERN, PROMPTS[0], drafter="head", draft=True, max_new_tokens=32,
                                 return_stats=True)
    assert text == base and stats.per_kind.get("head", {}).get("drafted", 0) > 0
    assert resolve_draft(None, handle, SpecOptions(drafter="auto")).head is not None  # auto drafts with it too
    assert generate_regex(handle, PATTERN, PROMPTS[0], max_new_tokens=32) == base

    # The same bytes elsewhere are the same file; another file has no head, and says how to train one.
    copy = tmp_path / "elsewhere" / "target-copy.gguf"
    copy.parent.mkdir()
    shutil.copy(target, copy)
    assert model_file_identity(copy) == model_file_identity(target)
    assert model_file_identity(other) != model_file_identity(target)
    with pytest.raises(InvalidOptionError, match="train-drafter --target"):
        generate_regex(load_model(str(other)), PATTERN, PROMPTS[0], drafter="head", draft=True, max_new_tokens=8)


def test_train_drafter_needs_out_where_the_target_is_no_file(monkeypatch):
    """A model with no GGUF file has no home for its head in the cache: --out is asked for."""
    from constrained_spec.cli.drafter import _head_dir

    class NoFile:
        gguf_file = None

    with pytest.raises(InvalidOptionError, match="--out"):
        _head_dir(NoFile(), None)
